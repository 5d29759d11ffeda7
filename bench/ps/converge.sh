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
P=${PS_P:-0.25}
MODEL=()
[ -n "${PS_MODEL:-}" ] && MODEL=(--model "$PS_MODEL")
[ -n "${PS_SEQ:-}" ] && MODEL+=(--seq "$PS_SEQ")
mkdir -p "$OUT"
BETON=$OUT/windows.beton
run() { # scenario mode data env...
  local sc=$1 mode=$2 data=$3
  local tag=$sc-${mode/:/} steps=$STEPS
  shift 3
  [ "$mode" = sync ] || steps=$STALE_STEPS
  echo "== $sc $mode"
  env "$@" "$BRAID" train --ps 1 --nproc-per-node $((W + 1)) --ps-mode "$mode" \
    --steps "$steps" --lr-steps "$STEPS" --eval-every "$EVAL" --log-every 100 --data "$data" \
    "${MODEL[@]}" --json "$OUT/$tag.json" > "$OUT/$tag.txt" 2>&1 ||
    { echo "$sc $mode failed:"; tail -5 "$OUT/$tag.txt"; return 1; }
  grep -E "step +$steps/|staleness of the" "$OUT/$tag.txt" | sed 's/^/  /'
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
  for mode in sync async "ssp:$BOUND"; do
    run "$sc" "$mode" "$data" "${straggle[@]}"
  done
  # The synchronous run's eval loss at its last step: the target.
  target=$(python3 -c "import json,sys; r=[s for s in json.load(open(sys.argv[1]))['steps'] if s.get('eval_loss') is not None]; print(r[-1]['eval_loss'])" "$OUT/$sc-sync.json")
  series=(--series "sync=$OUT/$sc-sync.json" --series "async=$OUT/$sc-async.json"
    --series "ssp:$BOUND=$OUT/$sc-ssp$BOUND.json")
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
