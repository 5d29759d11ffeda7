#!/bin/bash
# 4 or 8 GPUs (nvidia-h200-x4 / nvidia-h200-x8), issue 18: data-parallel,
# ZeRO-3 and hybrid-sharding scaling on one host, the 12.85B model on 4
# GPUs, and a rank killed mid-run. One phase per device call (the device
# tool stops a command at 600 s; every run here has a timeout and is
# skipped when the phase's 540 s would not leave it 30 s):
#
#   bash bench/device/x4.sh scale   (~6 min on 4 GPUs, ~8 on 8)
#     GPT-2 124M data parallel, batch 16 x 1024 per GPU, bf16, random
#     tokens: braid at 1, 2, 4 (and 8) GPUs (30 steps), PyTorch DDP eager
#     (torch_gpt2_bench.py) at the same counts, DDP --compile at G; then
#     traced braid runs (15 steps) at each count and `braid report` of
#     the largest with the others as --compare (the scaling section and
#     plot: $L/report-scaling.txt and .html); $L/scaling.tsv holds
#     braid's and PyTorch's points and $L/scaling.svg draws them on one
#     plot (`braid scale --plot-only`).
#   bash bench/device/x4.sh zero    (~4 min)
#     124M at G GPUs: braid data parallel, ZeRO-3 (--zero 3), hybrid
#     sharding (--zero 3 --shard-group G/2) and PyTorch FSDP2 (--fsdp),
#     with each braid run's bytes sent per rank per step (its "summary:
#     communication per step" line); then an f32 equivalence check
#     (L4-H4-C256-T256, 10 steps, seed 7, --precision f32): data parallel,
#     ZeRO-3 and HSDP each --save their parameters, compared by cmp.py
#     within a max abs diff of 1e-4. X4_ZERO_VARIANTS="NAME:VAR=VAL,..."
#     runs ZeRO-3 again per variant with its environment, in order.
#   bash bench/device/x4.sh big     (~8 min)
#     the 12.85B model L40-H40-C5120-V50304-T1024 on 4 GPUs, batch 8 x
#     1024 per GPU, activation checkpointing: braid ZeRO-3 (12 steps),
#     PyTorch FSDP2 and DeepSpeed ZeRO-3 (8 steps after 3 warm-up), each
#     with its MFU. X4_BIG_RECOMPUTE=1 adds braid with the attention
#     output recomputed (BRAID_CKPT_ATTENTION=recomputed); X4_BIG_BUDGET=1
#     adds braid told to fit FSDP2's measured peak of this call
#     (--gpu-memory: the attention's state kept in as many layers as
#     fit); X4_BIG_DS=0 skips DeepSpeed.
#   bash bench/device/x4.sh paths   (~4 min)
#     the gradients' path at G GPUs: braid data parallel, 124M, batch 16 x
#     1024 per GPU, its all-reduce over the copy engines
#     (BRAID_GPU_ALLREDUCE=ce) and over NCCL in turns (X4_ROUNDS, default
#     3), each round beside one GPU: the scaling of each run (X4_PATHS:
#     the BRAID_GPU_ALLREDUCE values, default "ce nccl").
#     X4_DP_VARIANTS="NAME|VAR=VAL,...|ARGS;NAME2|...|..." runs these
#     variants instead, each with its environment and extra arguments
#     (e.g. "default||;defer3||--defer-layers 3").
#   bash bench/device/x4.sh fault   (~2 min)
#     a G-GPU data-parallel 124M run (300 steps, a checkpoint every 50)
#     under `braid launch --max-restarts 1` with --resume auto; one rank,
#     chosen at random, SIGKILLed once rank 0 reports a step chosen at
#     random; beside an uninterrupted run with the same checkpoint
#     schedule. Checks that the launcher names the killed rank, that the
#     group resumes from the newest checkpoint written before the kill,
#     and that cmp.py finds the two final files bit-identical.
#
# Each braid run prints one line (its GPU summary, communication per step,
# model states, exit status), each peer its RESULT line; the full logs are
# under $L and come back as $OUT/logs.tgz.
# Carry: .dev/braid.gz .dev/commit .dev/anchors (bench/device/pack.sh).
#
# X4_COUNTS="1 2" sets the GPU counts of `scale` (a dry run on 2 GPUs);
# X4_PEERS=0 skips the PyTorch runs (braid alone, e.g. its traces).
#
# On a CPU-only machine: X4_LOCAL=1 bash bench/device/x4.sh PHASE runs
# without setup.sh (which would replace target/release/braid by a link):
# braid from $B (default target/release/braid), logs in $OUT/logs ($OUT
# default: a new temporary directory), 4 CPU ranks, --device cpu. `fault`
# runs in full on the tiny model (1000 steps, a checkpoint every 100);
# the other phases run their braid commands shrunk (tiny model, 3 steps)
# to check that the flags parse, and only print the peers' commands.
cd "$(dirname "$0")/../.." || exit 2
CMP=$PWD/bench/device/cmp.py
LIMIT=${X4_LIMIT:-540}
if [ "${X4_LOCAL:-0}" = 1 ]; then
  LOCAL=1
  export NCCL_NVLS_ENABLE=0
  B=${B:-$PWD/target/release/braid}
  OUT=${OUT:-$(mktemp -d /tmp/x4-out.XXXXXX)}
  L=$OUT/logs
  W=$OUT/work
  ANCHORS=/work/shared/anchors
  mkdir -p "$L"
  G=4
  DEV=cpu
  ds_install() { :; }
  finish() { echo "logs in $L"; }
else
  LOCAL=0
  source bench/device/setup.sh
  W=/tmp/x4
  G=$(nvidia-smi -L | grep -c GPU)
  DEV=cuda
fi
mkdir -p "$W"
[ -x "$B" ] || { echo "x4.sh: no braid at $B" >&2; exit 2; }
case $G in 4 | 8) ;; *) echo "warning: $G GPUs (expected 4 or 8)" ;; esac
echo "x4.sh ${1:-}: $G $DEV ranks, braid $B"

# The seconds a run may take: WANT, or what is left of the phase's
# LIMIT; fails when that is under 30.
budget() {
  local t=$1 left=$((LIMIT - SECONDS))
  [ "$t" -gt "$left" ] && t=$left
  [ "$t" -ge 30 ] || return 1
  echo "$t"
}
# Locally (X4_LOCAL=1): a GPU run's arguments shrunk for a CPU dry run.
shrink() {
  local out=()
  while [ $# -gt 0 ]; do
    case $1 in
      --model) out+=(--model tiny); shift ;;
      --steps) out+=(--steps 3); shift ;;
      --seq) out+=(--seq 32); shift ;;
      --batch) out+=(--batch 2); shift ;;
      *) out+=("$1") ;;
    esac
    shift
  done
  echo "${out[@]}"
}
# The tokens/s a log reports: braid's GPU summary (locally its CPU
# summary), a peer's RESULT line.
tok() {
  {
    grep -h 'gpu summary:' "$L/$1.txt" | grep -o '[0-9]* tokens/s'
    [ "$LOCAL" = 1 ] && grep -h 'summary: median step' "$L/$1.txt" | grep -o '[0-9]* tokens/s'
    grep -ho 'tok_s=[0-9]*' "$L/$1.txt" | cut -d= -f2
  } | head -1 | cut -d' ' -f1
}
# braid train on N local GPUs: name, seconds, N, arguments. The run's
# output goes to $L/NAME.txt (its command first), its tokens/s to
# $L/tok.tsv.
br() {
  local name=$1 t=$2 n=$3; shift 3
  local args=("$@")
  [ "$LOCAL" = 1 ] && read -ra args <<< "$(shrink "$@")"
  if ! t=$(budget "$t"); then
    echo "$name: skipped ($((LIMIT - SECONDS)) s left)"
    return 1
  fi
  echo "cmd: $B train --device $DEV --nproc $n --eval-every 0 ${args[*]}" > "$L/$name.txt"
  /usr/bin/time -v timeout -k 20 "$t" "$B" train --device $DEV --nproc "$n" --eval-every 0 \
    "${args[@]}" >> "$L/$name.txt" 2>&1
  local rc=$?
  echo "exit $rc" >> "$L/$name.txt"
  printf '%s\t%s\n' "$name" "$(tok "$name")" >> "$L/tok.tsv"
  local tp='gpu summary'
  [ "$LOCAL" = 1 ] && tp='summary: median step'
  echo "$name: $(grep -h "$tp\|communication per step\|model states\|memory estimate\|^exit\|error\|Maximum resident" "$L/$name.txt" |
    sed 's/^\[rank 0\] //' | tr '\n' ' ')"
  return $rc
}
# torchrun of a peer script in $ANCHORS on N GPUs: name, seconds, N,
# script, arguments.
peer() {
  local name=$1 t=$2 n=$3 script=$4; shift 4
  local cmd=(torchrun --standalone --nproc_per_node "$n" "$script" "$@")
  if [ "$LOCAL" = 1 ]; then
    echo "$name: not run locally: (cd \$ANCHORS && ${cmd[*]})"
    return 0
  fi
  if [ "${X4_PEERS:-1}" = 0 ]; then
    echo "$name: skipped (X4_PEERS=0)"
    return 0
  fi
  if ! t=$(budget "$t"); then
    echo "$name: skipped ($((LIMIT - SECONDS)) s left)"
    return 1
  fi
  echo "cmd: (cd $ANCHORS && ${cmd[*]})" > "$L/$name.txt"
  (cd "$ANCHORS" && timeout -k 20 "$t" "${cmd[@]}" >> "$L/$name.txt" 2>&1
   echo "exit $?" >> "$L/$name.txt")
  printf '%s\t%s\n' "$name" "$(tok "$name")" >> "$L/tok.tsv"
  echo "$name: $(grep -h 'RESULT\|^exit\|Error' "$L/$name.txt" | tail -4 | tr '\n' ' ')"
}
# Tokens/s of run NAME as recorded in tok.tsv (empty if none).
tps() { awk -F'\t' -v n="$1" '$1 == n { v = $2 } END { print v }' "$L/tok.tsv" 2>/dev/null; }
# "A / B = R" for two runs' tokens/s.
ratio() {
  local a b
  a=$(tps "$1") b=$(tps "$2")
  if [ -n "$a" ] && [ -n "$b" ] && [ "$b" != 0 ]; then
    awk -v a="$a" -v b="$b" -v x="$1" -v y="$2" 'BEGIN { printf "%s / %s = %.3f\n", x, y, a / b }'
  else
    echo "$1 / $2: missing ($1 ${a:-none}, $2 ${b:-none})"
  fi
}

phase_scale() {
  local counts="1 2 4" n top
  [ "$G" -ge 8 ] && counts="1 2 4 8"
  counts=${X4_COUNTS:-$counts}
  top=${counts##* }
  local M=(--model 124M --batch 16 --seq 1024 --data random)
  for n in $counts; do
    br dp-$n 100 $n "${M[@]}" --steps 30 --log-every 10 --json "$L/dp-$n.json"
  done
  for n in $counts; do
    peer ddp-$n 120 $n torch_gpt2_bench.py --model 124M --B 16 --T 1024 --steps 20 --warmup 5
  done
  peer ddpc-$top 240 $top torch_gpt2_bench.py --compile --model 124M --B 16 --T 1024 --steps 20 --warmup 5
  # Traced runs and braid's own scaling analysis.
  local cmp=() t
  for n in $counts; do
    rm -rf "$W/tr-$n"
    br tr-$n 70 $n "${M[@]}" --steps 15 --log-every 5 --trace "$W/tr-$n" || continue
    [ "$n" != "$top" ] && cmp+=(--compare "$W/tr-$n")
  done
  if [ -d "$W/tr-$top" ] && t=$(budget 60); then
    echo "cmd: $B report $W/tr-$top ${cmp[*]} --html $L/report-scaling.html" > "$L/report-scaling.txt"
    timeout "$t" "$B" report "$W/tr-$top" "${cmp[@]}" --html "$L/report-scaling.html" >> "$L/report-scaling.txt" 2>&1
    echo "exit $?" >> "$L/report-scaling.txt"
    timeout "$t" "$B" report "$W/tr-$top" "${cmp[@]}" --json > "$L/report-scaling.json" 2> /dev/null
    echo "== braid report's scaling section ($L/report-scaling.html)"
    sed -n '/^-- scaling efficiency/,/^$/p' "$L/report-scaling.txt"
    grep -E '^(exit [^0]|braid: error)' "$L/report-scaling.txt"
    tar czf "$L/traces.tgz" -C "$W" $(cd "$W" && ls -d tr-* 2> /dev/null)
  else
    echo "report: skipped (no trace of $top ranks, or no time left)"
  fi
  # Scaling against each system's own 1-GPU run, and braid against PyTorch.
  echo "== scaling (tokens/s; efficiency against the same system's 1-GPU run)"
  printf 'series\tgpus\ttokens_per_s\tefficiency\n' > "$L/scaling.tsv"
  local sys
  for sys in dp:braid ddp:pytorch-ddp ddpc:pytorch-ddp-compile; do
    for n in $counts; do
      local v b1
      v=$(tps "${sys%%:*}-$n") b1=$(tps "${sys%%:*}-1")
      [ -n "$v" ] || continue
      awk -v s="${sys#*:}" -v n="$n" -v v="$v" -v b="$b1" 'BEGIN {
        e = (b > 0) ? sprintf("%.1f%%", 100 * v / (n * b)) : "-"
        printf "%s\t%d\t%d\t%s\n", s, n, v, e }' | tee -a "$L/scaling.tsv"
    done
  done
  for n in $counts; do ratio dp-$n ddp-$n; done
  ratio dp-$top ddpc-$top
  plot_scaling
}

# $L/scaling.svg from $L/scaling.tsv, drawn by braid (`braid scale
# --plot-only`): tokens/s against GPUs, braid and PyTorch, with braid's
# ideal (linear from its 1-GPU run).
plot_scaling() {
  local title="GPT-2 124M data parallel, 16 x 1024 tokens per GPU, bf16"
  [ "$LOCAL" = 1 ] && title="x4.sh scale, dry run on CPU ranks: tiny model, 3 steps"
  "$B" scale --plot-only "$L/scaling.tsv" --out "$L" --title "$title" || echo "plot: failed"
}

phase_zero() {
  local M=(--model 124M --batch 16 --seq 1024 --data random --steps 30 --log-every 10)
  local g=$((G / 2))
  br dp-$G 100 $G "${M[@]}" --json "$L/dp-$G.json"
  br z3-$G 120 $G --zero 3 "${M[@]}" --json "$L/z3-$G.json"
  # X4_ZERO_VARIANTS="NAME:VAR=VAL,VAR=VAL ...": the ZeRO-3 run again per
  # variant, with its environment set (z3-G-NAME.txt), each against it.
  local v name envs
  for v in ${X4_ZERO_VARIANTS:-}; do
    name=${v%%:*} envs=${v#*:}
    [ "$envs" = "$v" ] && envs=
    (
      IFS=, read -ra kvs <<< "$envs"
      for kv in "${kvs[@]}"; do export "${kv?}"; done
      br "z3-$G-$name" 120 $G --zero 3 "${M[@]}" --json "$L/z3-$G-$name.json"
    )
    ratio "z3-$G-$name" "z3-$G"
  done
  br hsdp$g-$G 120 $G --zero 3 --shard-group $g "${M[@]}" --json "$L/hsdp$g-$G.json"
  peer fsdp2-$G 120 $G torch_gpt2_bench.py --fsdp --model 124M --B 16 --T 1024 --steps 20 --warmup 5
  echo "== 124M on $G GPUs"
  ratio z3-$G dp-$G
  ratio z3-$G fsdp2-$G
  ratio hsdp$g-$G z3-$G
  ratio hsdp$g-$G dp-$G
  echo "== bytes on the wire per step (each rank's, braid's own count)"
  local r
  for r in dp-$G z3-$G hsdp$g-$G; do
    echo "$r: $(grep -h 'communication per step' "$L/$r.txt" 2> /dev/null | sed 's/.*communication per step: //')"
  done
  # Equivalence in f32: the same seed and steps under three strategies.
  local E=(--model L4-H4-C256-T256 --data synthetic --seq 256 --batch 4 --steps 10 --seed 7
    --precision f32 --log-every 5)
  rm -f "$W"/eq-*.safetensors
  br eq-dp 90 $G "${E[@]}" --save "$W/eq-dp.safetensors"
  br eq-z3 90 $G --zero 3 "${E[@]}" --save "$W/eq-z3.safetensors"
  br eq-hsdp 90 $G --zero 3 --shard-group $g "${E[@]}" --save "$W/eq-hsdp.safetensors"
  echo "== f32 equivalence after 10 steps (tolerance: max abs diff 1e-4)"
  local a b
  for a in z3 hsdp; do
    python3 "$CMP" "$W/eq-dp.safetensors" "$W/eq-$a.safetensors" --tol 1e-4 > "$L/eq-dp-$a.txt" 2>&1
    echo "eq dp vs $a: exit $? | $(grep -v '^[AB] ' "$L/eq-dp-$a.txt" | tr '\n' ' ')"
  done
  python3 "$CMP" "$W/eq-z3.safetensors" "$W/eq-hsdp.safetensors" --tol 1e-4 > "$L/eq-z3-hsdp.txt" 2>&1
  echo "eq z3 vs hsdp: exit $? | $(grep -v '^[AB] ' "$L/eq-z3-hsdp.txt" | tr '\n' ' ')"
}

phase_big() {
  local M=L40-H40-C5120-V50304-T1024
  # X4_BIG_PLAIN=0 skips braid's run without a budget.
  [ "${X4_BIG_PLAIN:-1}" = 0 ] || br z3-13b 170 4 --zero 3 --model $M --batch 8 --seq 1024 --data random \
    --checkpointing --steps 12 --log-every 2 --json "$L/z3-13b.json"
  # X4_BIG_RECOMPUTE=1: again with the attention output recomputed under
  # checkpointing (FSDP2 saves only each layer's input).
  if [ "${X4_BIG_RECOMPUTE:-0}" = 1 ]; then
    BRAID_CKPT_ATTENTION=recomputed br z3-13b-recomputed 170 4 --zero 3 --model $M --batch 8 \
      --seq 1024 --data random --checkpointing --steps 12 --log-every 2 --json "$L/z3-13b-recomputed.json"
  fi
  peer fsdp2-13b 150 4 torch_gpt2_bench.py --fsdp --act-ckpt --model L40-H40-C5120 --B 8 --T 1024 --steps 8 --warmup 3
  # X4_BIG_BUDGET=1: braid within FSDP2's peak of this call.
  if [ "${X4_BIG_BUDGET:-0}" = 1 ]; then
    local cap
    cap=$(grep -ho 'peak_mem_GiB=[0-9.]*' "$L/fsdp2-13b.txt" 2>/dev/null | tail -1 | cut -d= -f2)
    if [ -n "$cap" ]; then
      br z3-13b-capped 170 4 --zero 3 --model $M --batch 8 --seq 1024 --data random --checkpointing \
        --steps 12 --log-every 2 --gpu-memory "$cap" --json "$L/z3-13b-capped.json"
      grep -h 'GPU memory estimate' "$L/z3-13b-capped.txt" | head -1
      ratio z3-13b-capped fsdp2-13b
      # X4_BIG_VARIANTS="NAME:VAR=VAL,VAR=VAL NAME2:...": the budgeted
      # run again per variant, in order, with its environment set
      # (z3-13b-NAME.txt), each against FSDP2 and the first run.
      local v name envs c=(--zero 3 --model $M --batch 8 --seq 1024 --data random --checkpointing
        --steps 12 --log-every 2 --gpu-memory "$cap")
      for v in ${X4_BIG_VARIANTS:-}; do
        name=${v%%:*} envs=${v#*:}
        [ "$envs" = "$v" ] && envs=
        (
          IFS=, read -ra kvs <<< "$envs"
          for kv in "${kvs[@]}"; do export "${kv?}"; done
          br "z3-13b-$name" 170 4 "${c[@]}" --json "$L/z3-13b-$name.json"
        )
        ratio "z3-13b-$name" fsdp2-13b
        ratio "z3-13b-$name" z3-13b-capped
      done
    else
      echo "z3-13b-capped: skipped (no FSDP2 peak in fsdp2-13b.txt)"
    fi
  fi
  if [ "${X4_BIG_DS:-1}" = 0 ]; then
    # (Only the runs this call made.)
    [ "${X4_BIG_PLAIN:-1}" = 0 ] || ratio z3-13b fsdp2-13b
    [ "${X4_BIG_RECOMPUTE:-0}" = 1 ] && ratio z3-13b-recomputed fsdp2-13b
    return 0
  fi
  ds_install
  peer ds-13b 210 4 ds_gpt2_bench.py --zero 3 --act-ckpt --model L40-H40-C5120 --B 8 --T 1024 --steps 8 --warmup 3
  echo "== 12.85B on 4 GPUs"
  ratio z3-13b fsdp2-13b
  ratio z3-13b ds-13b
}

# braid launch of G workers writing their pids to $W/pids/pid.RANK.RESTART,
# then running `braid train ARGS`: log name, seconds, --max-restarts,
# train arguments. Runs in the background when the log name ends in "&"
# (the caller waits for $launched).
launch() {
  local name=$1 t=$2 restarts=$3 bg=
  shift 3
  case $name in *'&') name=${name%&} bg=1 ;; esac
  local script="echo \$\$ > $W/pids/pid.\$RANK.\$BRAID_RESTART_COUNT; exec $B train $*"
  local cmd=(timeout -k 20 "$t" "$B" launch --standalone --nproc-per-node "$G" --max-restarts "$restarts"
    --log-dir "$L/$name-ranks" -- sh -c "$script")
  echo "cmd: ${cmd[*]:4}" > "$L/$name.txt"
  if [ -n "$bg" ]; then
    "${cmd[@]}" >> "$L/$name.txt" 2>&1 &
    launched=$!
  else
    "${cmd[@]}" >> "$L/$name.txt" 2>&1
    local rc=$?
    echo "exit $rc" >> "$L/$name.txt"
    return $rc
  fi
}

phase_fault() {
  local M steps every lo hi
  if [ "$LOCAL" = 1 ]; then
    M="--model tiny --batch 4 --seq 32 --data random" steps=1000 every=100 lo=150 hi=850
  else
    M="--model 124M --batch 8 --seq 1024 --data random" steps=300 every=50 lo=60 hi=280
  fi
  rm -rf "$W/pids" "$W/ref" "$W/ck" "$W"/ref.safetensors "$W"/killed.safetensors
  mkdir -p "$W/pids"
  local T="--device $DEV $M --steps $steps --eval-every 0 --seed 11 --log-every 1 --save-every $every --keep 2 --resume auto"
  local t
  t=$(budget 200) || { echo "fault: skipped (no time)"; return 1; }
  launch fault-ref "$t" 0 $T --ckpt-dir "$W/ref" --save "$W/ref.safetensors"
  echo "fault-ref (uninterrupted): exit $? | $(grep -h 'summary: median step\|gpu summary\|saved .*safetensors\|error' "$L/fault-ref.txt" | sed 's/^\[rank 0\] //' | tr '\n' ' ')"
  # The killed run: rank R SIGKILLed once rank 0 has reported step S.
  local S=$((lo + RANDOM % (hi - lo))) R=$((RANDOM % G))
  t=$(budget 240) || { echo "fault: skipped (no time)"; return 1; }
  launch 'fault-killed&' "$t" 1 $T --ckpt-dir "$W/ck" --save "$W/killed.safetensors"
  local log=$L/fault-killed.txt deadline=$((SECONDS + t))
  while ! grep -qE "^\[rank 0\] step +$S/" "$log"; do
    if ! kill -0 "$launched" 2> /dev/null || [ $SECONDS -ge $deadline ]; then break; fi
    sleep 0.05
  done
  local pid at
  pid=$(cat "$W/pids/pid.$R.0" 2> /dev/null)
  at=$(grep -oE '^\[rank 0\] step +[0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$')
  if [ -n "$pid" ] && kill -KILL "$pid" 2> /dev/null; then
    echo "fault: SIGKILL to rank $R (pid $pid) when rank 0 had reported step $at (aimed at $S)"
  else
    echo "fault: could not kill rank $R (pid '${pid}'): the run ended or never reached step $S"
  fi
  wait "$launched"
  local rc=$?
  echo "exit $rc" >> "$log"
  # What the launcher said, what the group resumed from.
  local failed cause resumed newest
  failed=$(grep -n 'braid launch: the job failed' "$log" | head -1 | cut -d: -f1)
  cause=$(grep -h 'root cause:' "$log" | head -1 | sed 's/^ *//')
  resumed=$(grep -h 'resuming from' "$log" | head -1 | grep -oE '\(step [0-9]+' | grep -oE '[0-9]+')
  newest=$([ -n "$failed" ] && head -n "$failed" "$log" | grep -oE 'checkpoint step-[0-9]+ saved' |
    tail -1 | grep -oE '[0-9]+' | sed 's/^0*//')
  echo "fault-killed: exit $rc | launcher: ${cause:-no root cause line} | $(grep -h 'restarting the worker group' "$log" | sed 's/^ *//')"
  echo "fault-killed: $(grep -h 'world (' "$log" | head -1 | sed 's/^ *//')"
  echo "fault-killed: newest checkpoint before the failure: step ${newest:-none}; resumed from step ${resumed:-none}"
  python3 "$CMP" "$W/ref.safetensors" "$W/killed.safetensors" > "$L/fault-cmp.txt" 2>&1
  local same=$?
  echo "fault cmp.py (uninterrupted vs killed): exit $same | $(grep -v '^[AB] ' "$L/fault-cmp.txt" | tr '\n' ' ')"
  local ok=1 why=()
  [ "$rc" = 0 ] || { ok=0; why+=("the launcher exited $rc"); }
  echo "$cause" | grep -q "rank $R (" || { ok=0; why+=("the launcher's root cause does not name rank $R"); }
  grep -q 'restarting the worker group' "$log" || { ok=0; why+=("no restart"); }
  [ -n "$resumed" ] && [ "$resumed" = "${newest:-0}" ] ||
    { ok=0; why+=("resumed from step '${resumed}', newest checkpoint before the failure '${newest}'"); }
  [ "$same" = 0 ] || { ok=0; why+=("final parameters not bit-identical (cmp.py exit $same)"); }
  if [ $ok = 1 ]; then
    echo "fault: PASS (rank $R killed at step ~$at of $steps, named by the launcher, resumed from step $resumed, final parameters bit-identical to the uninterrupted run's)"
  else
    echo "fault: FAIL: $(IFS=';'; echo "${why[*]}")"
  fi
  [ $ok = 1 ]
}

# The gradients' path at G GPUs: braid data parallel on the 124M model
# with its all-reduce over the copy engines and over NCCL, in turns
# (X4_ROUNDS rounds, default 3), beside one GPU: the median step and its
# parts of each run.
phase_paths() {
  local M=(--model 124M --batch 16 --seq 1024 --data random --steps 30 --log-every 10)
  local i via s name envs extra specs=() names=()
  # Each variant is NAME|VAR=VAL,...|EXTRA ARGUMENTS.
  if [ -n "${X4_DP_VARIANTS:-}" ]; then
    IFS=';' read -ra specs <<< "$X4_DP_VARIANTS"
  else
    for via in ${X4_PATHS:-ce nccl}; do specs+=("$via|BRAID_GPU_ALLREDUCE=$via|"); done
  fi
  for s in "${specs[@]}"; do names+=("${s%%|*}"); done
  for i in $(seq "${X4_ROUNDS:-3}"); do
    br one-$i 60 1 "${M[@]}"
    for s in "${specs[@]}"; do
      IFS='|' read -r name envs extra <<< "$s"
      (
        IFS=, read -ra kvs <<< "$envs"
        for kv in "${kvs[@]}"; do [ -n "$kv" ] && export "${kv?}"; done
        # shellcheck disable=SC2086 # the extra arguments split on spaces
        br "$name-$G-$i" 80 "$G" "${M[@]}" $extra
      )
      grep -h 'an average step of this rank' "$L/$name-$G-$i.txt" | sed 's/^\[rank 0\] summary: /    /'
    done
  done
  for via in "${names[@]}"; do
    for i in $(seq "${X4_ROUNDS:-3}"); do
      awk -F'\t' -v v="$via-$G-$i" -v o="one-$i" -v g="$G" '$1 == v { x = $2 } $1 == o { y = $2 }
        END { if (x && y) printf "%s: %d tokens/s, scaling %.1f%% against one-%s\n", v, x, 100 * x / (g * y), substr(o, 5) }' "$L/tok.tsv"
    done
  done
}

phase=${1:-}
case $phase in
scale) phase_scale ;;
paths) phase_paths ;;
zero) phase_zero ;;
big) phase_big ;;
fault) phase_fault ;;
*)
  echo "usage: x4.sh scale|zero|big|fault|paths (X4_LOCAL=1 for a CPU run here)" >&2
  exit 2
  ;;
esac
rc=$?
echo "x4.sh $phase: ${SECONDS} s"
finish
exit $rc
