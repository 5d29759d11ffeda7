#!/bin/bash
# The parameter server's consistency modes against each other: loss by
# step and by wall-clock time, drawn and tabulated by `braid plot`.
#
#   bash bench/ps/converge.sh OUT [SCENARIO...]
#
# Runs `braid train --ps 1` with W workers (PS_WORKERS, default 4) of the
# tiny model for PS_STEPS steps (default 400; evaluated every 50) under
# --ps-mode sync, async and ssp:PS_BOUND (default 2), in each scenario:
#   equal      every worker at the same speed, the built-in corpus
#   beton      the same on a .beton of token windows (braid data write)
#   transient  each worker's step, with probability PS_P (default 0.25),
#              slowed by its own length (BRAID_TEST_STRAGGLE: the SSP
#              paper's transient stragglers)
#   slow       worker 1 at half speed throughout (BRAID_TEST_STRAGGLE=1@1)
# (default: all four). Writes OUT/SCENARIO-MODE.json (braid train --json; MODE without its colon),
# OUT/SCENARIO-MODE.txt (its output), OUT/SCENARIO-{step,time}.svg and
# OUT/SCENARIO.md (braid plot's table and, against the synchronous run's
# eval loss at the last step, when each run first reached it: step,
# wall-clock seconds, and seconds of training without the evaluations).
# PS_STALE_STEPS (default: PS_STEPS) gives async and ssp more steps than
# sync, on sync's schedule (--lr-steps PS_STEPS: the learning rate holds its
# floor after it), so that "when did each reach sync's final loss" is
# measured rather than extrapolated; PS_EVAL (default 50) evaluates more
# often, to place that step closer.
# PS_MODEL and PS_SEQ (default: the tiny model, sequences of 64) set a
# larger model, so that a step is mostly computation and a straggler's
# delay (its own step's length) weighs on a synchronous step as in the SSP
# paper: with the tiny model a step is mostly the servers' round trip.
# PS_SEEDS (a list; default: one run, the default seed, stragglers drawn
# with seed 7) repeats each scenario per seed (--seed S, stragglers drawn
# with S; files OUT/SCENARIO-MODE-sS.*), each seed's runs measured against
# its own synchronous run, and ends with OUT/SCENARIO-seeds.md: per seed
# and mode, when sync's final loss was first reached and how much sooner
# than sync. PS_MODES (default "sync async ssp:PS_BOUND") picks the modes;
# sync must be among them.
# BRAID (default: braid on PATH) is the binary. Runs one at a time: each
# has the machine to itself. (Files name ssp:S as sspS.)
set -euo pipefail
OUT=${1:?usage: converge.sh OUT [SCENARIO...]}
shift || true
SCENARIOS=${*:-equal beton transient slow}
BRAID=${BRAID:-braid}
W=${PS_WORKERS:-4}
STEPS=${PS_STEPS:-400}
STALE_STEPS=${PS_STALE_STEPS:-$STEPS}
EVAL=${PS_EVAL:-50}
BOUND=${PS_BOUND:-2}
MODES=${PS_MODES:-sync async ssp:$BOUND}
SEEDS=${PS_SEEDS:-}
P=${PS_P:-0.25}
MODEL=()
[ -n "${PS_MODEL:-}" ] && MODEL=(--model "$PS_MODEL")
[ -n "${PS_SEQ:-}" ] && MODEL+=(--seq "$PS_SEQ")
mkdir -p "$OUT"
BETON=$OUT/windows.beton
run() { # scenario mode data seed env...
  local sc=$1 mode=$2 data=$3 seed=$4
  local tag=$sc-${mode/:/}${seed:+-s$seed} steps=$STEPS
  shift 4
  [ "$mode" = sync ] || steps=$STALE_STEPS
  echo "== $sc $mode${seed:+ (seed $seed)}"
  env "$@" "$BRAID" train --ps 1 --nproc-per-node $((W + 1)) --ps-mode "$mode" \
    --steps "$steps" --lr-steps "$STEPS" --eval-every "$EVAL" --log-every 100 --data "$data" \
    ${seed:+--seed "$seed"} "${MODEL[@]}" --json "$OUT/$tag.json" > "$OUT/$tag.txt" 2>&1 ||
    { echo "$sc $mode failed:"; tail -5 "$OUT/$tag.txt"; return 1; }
  grep -E "step +$steps/|staleness of the" "$OUT/$tag.txt" | sed 's/^/  /'
}
# When each run of seed $2 in scenario $1 first reached that seed's sync
# run's final eval loss: a table row per mode.
reached() {
  python3 - "$OUT" "$1" "$2" $MODES <<'PY'
import json, sys
out, sc, seed, modes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def load(mode):
    tag = f"{sc}-{mode.replace(':', '')}" + (f"-s{seed}" if seed else "")
    return [s for s in json.load(open(f"{out}/{tag}.json"))["steps"] if s.get("eval_loss") is not None]
target = load("sync")[-1]["eval_loss"]
def first(mode):
    for s in load(mode):
        if s["eval_loss"] <= target:
            return s["step"], s["elapsed_s"]
    return None
sync = first("sync")
for mode in modes:
    f = first(mode)
    what = "not reached" if f is None else f"step {f[0]}, {f[1]:.2f} s ({sync[1] / f[1]:.2f}x)"
    print(f"| {seed or 'default'} | {mode} | {target:.4f} | {what} |")
PY
}
for sc in $SCENARIOS; do
  data=synthetic
  straggle=()
  case $sc in
    equal) ;;
    beton)
      [ -f "$BETON" ] || "$BRAID" data write --tokens synthetic --seq 64 "$BETON" > /dev/null
      data=$BETON ;;
    transient) straggle=(BRAID_TEST_STRAGGLE="$P:7") ;;
    slow) straggle=(BRAID_TEST_STRAGGLE=1@1) ;;
    *) echo "unknown scenario $sc"; exit 2 ;;
  esac
  if [ -n "$SEEDS" ]; then
    echo "| seed | mode | sync's final eval loss | first reached |" > "$OUT/$sc-seeds.md"
    echo "|---|---|---:|---|" >> "$OUT/$sc-seeds.md"
    for seed in $SEEDS; do
      seeded=("${straggle[@]}")
      [ ${#seeded[@]} -gt 0 ] && [ "$sc" = transient ] && seeded=(BRAID_TEST_STRAGGLE="$P:$seed")
      for mode in $MODES; do
        run "$sc" "$mode" "$data" "$seed" "${seeded[@]}"
      done
      reached "$sc" "$seed" >> "$OUT/$sc-seeds.md"
    done
    series=()
    for mode in $MODES; do
      files=$(for seed in $SEEDS; do printf '%s,' "$OUT/$sc-${mode/:/}-s$seed.json"; done)
      series+=(--series "$mode=${files%,}")
    done
    "$BRAID" plot "${series[@]}" --y eval_loss --out "$OUT/$sc-step.svg" \
      --title "$sc: eval loss by step, $(echo $SEEDS | wc -w) seeds" > "$OUT/$sc.md" 2>/dev/null || true
    cat "$OUT/$sc-seeds.md"
    continue
  fi
  for mode in $MODES; do
    run "$sc" "$mode" "$data" "" "${straggle[@]}"
  done
  # The synchronous run's eval loss at its last step: the target.
  target=$(python3 -c "import json,sys; r=[s for s in json.load(open(sys.argv[1]))['steps'] if s.get('eval_loss') is not None]; print(r[-1]['eval_loss'])" "$OUT/$sc-sync.json")
  series=()
  for mode in $MODES; do series+=(--series "$mode=$OUT/$sc-${mode/:/}.json"); done
  {
    echo "## $sc ($W workers, 1 server, $STEPS steps; async and ssp $STALE_STEPS)"
    echo
    "$BRAID" plot "${series[@]}" --y eval_loss --out "$OUT/$sc-step.svg" --reach "$target" \
      --title "$sc: eval loss by step" 2>/dev/null
    "$BRAID" plot "${series[@]}" --y eval_loss --x elapsed_s --out "$OUT/$sc-time.svg" \
      --title "$sc: eval loss by wall-clock seconds" > /dev/null 2>&1
    echo
  } > "$OUT/$sc.md"
  cat "$OUT/$sc.md"
done
