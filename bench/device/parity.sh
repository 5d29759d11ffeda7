#!/bin/bash
# Issue 64: learning parity with PyTorch on real text, on one GPU.
#
#   bash bench/device/parity.sh onestep          # the one-step check, bf16 and f32 (124M; ONESTEP_VARIANTS)
#   bash bench/device/parity.sh bf16 1337 7      # 124M, 2,000 steps (PARITY_STEPS), per seed: braid, then PyTorch
#   bash bench/device/parity.sh f32 1337 7       # the same in f32, 600 steps
#   bash bench/device/parity.sh big 1337 7       # 1558M, batch 8, 400 steps
#   bash bench/device/parity.sh fp8 1337         # 124M, 2,000 steps: braid bf16, then braid --precision fp8
#   bash bench/device/parity.sh fp8big 1337      # the same at 1558M, batch 8 (2,000 steps: split the
#                                                # two over calls with FP8_PRECISIONS="bf16" / "fp8")
#   bash bench/device/parity.sh plot             # the table and curves of every run in $L
#
# The fp8 phases (issue 69: FP8 tracks bf16's loss within 1 % at step
# 2,000) run braid alone, each precision of FP8_PRECISIONS (default "bf16
# fp8"; BRAID_FP8_SCALING passes through) from the same seed, and draw
# them as two series.
#
# Every phase first makes the corpus (once per machine): the Python sources
# that ship with the machine's packages (the standard library, then torch's
# and transformers', in sorted order: code with its comments and
# docstrings, decoded as UTF-8 with broken bytes dropped), PARITY_BYTES of
# it (default 48 MB: about 20 M GPT-2 tokens, so 2,000 steps of 16 x 1,024
# see each training window at most twice), tokenised by braid into an
# llm.c shard (`braid data write --tokens corpus.txt corpus.bin`), which
# braid and bench/torch_gpt_recipe.py both read: the last tenth held out,
# evaluated on the same windows. Both follow braid's recipe (its init, its
# sampler's order, warm-up PARITY_WARMUP, default a tenth of the steps,
# then a cosine to a tenth of the peak, AdamW 0.9/0.95, weight decay 0.1,
# clip 1.0), PyTorch from braid's initial weights for the seed
# (PARITY_SAME_INIT=0: its own draw). Runs write
# $L/parity-<phase>-<system>-<seed>.json; `plot`
# (and the end of each run phase) draws them with `braid plot`.
#
# Carry: .dev/braid.gz .dev/commit (after `bash bench/device/pack.sh`).
set -uo pipefail
cd "$(dirname "$0")/../.."
. bench/device/setup.sh
phase=${1:-onestep}
shift || true
SEEDS=${*:-1337 7}
CORPUS=/tmp/corpus.bin
PY=python3
export PYTHONUNBUFFERED=1

corpus() {
  [ -s "$CORPUS" ] && return 0
  local t0=$SECONDS
  $PY - "${PARITY_BYTES:-48000000}" > /tmp/corpus.txt <<'EOF'
import os, sys, sysconfig, importlib.util
want = int(sys.argv[1])
roots = [sysconfig.get_paths()["stdlib"]]
for pkg in ["torch", "transformers"]:
    spec = importlib.util.find_spec(pkg)
    if spec and spec.origin:
        roots.append(os.path.dirname(spec.origin))
files = []
for root in roots:
    for d, _, names in os.walk(root):
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
got = 0
out = sys.stdout
for path in sorted(files):
    try:
        text = open(path, "rb").read().decode("utf-8", errors="ignore")
    except OSError:
        continue
    out.write(text + "\n")
    got += len(text) + 1
    if got >= want:
        break
print(f"corpus: {got} characters from {len(files)} files under {roots}", file=sys.stderr)
EOF
  $B data write --tokens /tmp/corpus.txt "$CORPUS" --tokenizer gpt2 2>&1 | tee "$L/parity-corpus.txt"
  echo "corpus made in $((SECONDS - t0)) s" | tee -a "$L/parity-corpus.txt"
}

# run_pair PHASE SEED MODEL BATCH STEPS PRECISION: braid, then PyTorch.
run_pair() {
  local phase=$1 seed=$2 model=$3 batch=$4 steps=$5 precision=$6
  local warmup=${PARITY_WARMUP:-$((steps / 10))} every=${PARITY_EVERY:-100}
  local t0=$SECONDS init=()
  if [ "${PARITY_SAME_INIT:-1}" = 1 ]; then
    # braid's own initial weights for this seed (one step at a vanishing
    # learning rate leaves them unchanged in f32): PyTorch starts from them,
    # so that the two differ in their arithmetic alone (seeds still vary
    # both the init and the data order).
    $B train --device cuda --model "$model" --data "$CORPUS" --tokenizer gpt2 --batch "$batch" \
      --seq 1024 --steps 1 --lr 1e-30 --warmup 1 --eval-every 0 --seed "$seed" \
      --precision "$precision" --save "/tmp/init-$model-$seed.safetensors" > /dev/null 2>&1 &&
      init=(--init "/tmp/init-$model-$seed.safetensors")
  fi
  $B train --device cuda --model "$model" --data "$CORPUS" --tokenizer gpt2 --batch "$batch" \
    --seq 1024 --steps "$steps" --warmup "$warmup" --eval-every "$every" --seed "$seed" \
    --precision "$precision" --log-every 100 --json "$L/parity-$phase-braid-$seed.json" \
    > "$L/parity-$phase-braid-$seed.txt" 2>&1
  echo "$phase braid seed $seed: exit $? in $((SECONDS - t0)) s | $(grep -h 'gpu summary' "$L/parity-$phase-braid-$seed.txt" | sed 's/.*median/median/')"
  t0=$SECONDS
  $PY bench/torch_gpt_recipe.py --data "$CORPUS" --model "$model" --batch "$batch" --seq 1024 \
    --steps "$steps" --warmup "$warmup" --eval-every "$every" --seed "$seed" \
    --precision "$precision" "${init[@]}" --json "$L/parity-$phase-torch-$seed.json" \
    > "$L/parity-$phase-torch-$seed.txt" 2>&1
  echo "$phase torch seed $seed: exit $? in $((SECONDS - t0)) s | $(tail -1 "$L/parity-$phase-torch-$seed.txt")"
}

# run_braid PHASE SEED MODEL BATCH STEPS PRECISION: braid alone, into
# $L/parity-PHASE-PRECISION-SEED.json.
run_braid() {
  local phase=$1 seed=$2 model=$3 batch=$4 steps=$5 precision=$6 t0=$SECONDS
  local warmup=${PARITY_WARMUP:-$((steps / 10))} every=${PARITY_EVERY:-100}
  local n="parity-$phase-$precision-$seed"
  echo "cmd: ${BRAID_FP8_SCALING:+BRAID_FP8_SCALING=$BRAID_FP8_SCALING }braid train --model $model --batch $batch --steps $steps --precision $precision --seed $seed" > "$L/$n.txt"
  $B train --device cuda --model "$model" --data "$CORPUS" --tokenizer gpt2 --batch "$batch" \
    --seq 1024 --steps "$steps" --warmup "$warmup" --eval-every "$every" --seed "$seed" \
    --precision "$precision" --log-every 100 --json "$L/$n.json" >> "$L/$n.txt" 2>&1
  echo "$phase $precision seed $seed: exit $? in $((SECONDS - t0)) s | $(grep -h 'gpu summary' "$L/$n.txt" | sed 's/.*median/median/')"
}

# plot_series PHASE LABEL=TAG...: the runs of PHASE in $L by tag
# ($L/parity-PHASE-TAG-SEED.json), each tag's seeds one series, as curves
# and a table; nothing where a tag has no run.
plot_series() {
  local phase=$1 spec files args=()
  shift
  for spec in "$@"; do
    files=$(ls "$L"/parity-"$phase"-"${spec#*=}"-*.json 2>/dev/null | tr '\n' ',' | sed 's/,$//')
    [ -n "$files" ] || return 0
    args+=(--series "${spec%%=*}=$files")
  done
  $B plot "${args[@]}" --title "GPT-2 $phase: held-out loss" \
    --out "$OUT/parity-$phase.svg" --json "$L/parity-$phase-table.json" | tee "$L/parity-$phase-table.md"
}

# plot PHASE: braid's and PyTorch's runs of PHASE; plot_fp8 PHASE: braid's
# bf16 and fp8 runs.
plot() { plot_series "$1" braid=braid PyTorch=torch; }
plot_fp8() { plot_series "$1" "braid bf16=bf16" "braid fp8=fp8"; }

case $phase in
  corpus) corpus ;;
  onestep)
    # ONESTEP_PRECISIONS (default "f32 bf16"); ONESTEP_VARIANTS: braid's
    # environment per check, "default" or VAR=VAL[,VAR=VAL] (e.g.
    # "default BRAID_SAVED_IN_GRADS=off").
    corpus
    for p in ${ONESTEP_PRECISIONS:-f32 bf16}; do
      for v in ${ONESTEP_VARIANTS:-default}; do
        vars=()
        [ "$v" = default ] || IFS=, read -ra vars <<< "$v"
        env "${vars[@]}" $PY bench/torch_one_step.py --braid "$B" --dir "/tmp/onestep-$p" \
          --model 124M --data "$CORPUS" --precision "$p" 2>&1 | tee "$L/parity-onestep-$p-$v.txt"
        echo "onestep $p $v: exit ${PIPESTATUS[0]}"
      done
    done
    ;;
  bf16) corpus; for s in $SEEDS; do run_pair bf16 "$s" 124M 16 "${PARITY_STEPS:-2000}" bf16; done; plot bf16 ;;
  f32) corpus; for s in $SEEDS; do run_pair f32 "$s" 124M 16 "${PARITY_STEPS:-600}" f32; done; plot f32 ;;
  big) corpus; for s in $SEEDS; do run_pair big "$s" 1558M 8 "${PARITY_STEPS:-400}" bf16; done; plot big ;;
  fp8 | fp8big)
    corpus
    case $phase in fp8) spec=(124M 16) ;; *) spec=(1558M 8) ;; esac
    for s in $SEEDS; do
      for p in ${FP8_PRECISIONS:-bf16 fp8}; do
        run_braid "$phase" "$s" "${spec[@]}" "${PARITY_STEPS:-2000}" "$p"
      done
    done
    plot_fp8 "$phase"
    ;;
  plot) for p in bf16 f32 big; do plot "$p"; done; for p in fp8 fp8big; do plot_fp8 "$p"; done ;;
  *) echo "parity.sh: unknown phase $phase (onestep, bf16, f32, big, fp8, fp8big, plot, corpus)"; exit 2 ;;
esac
finish
