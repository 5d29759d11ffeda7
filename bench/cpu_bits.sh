#!/bin/bash
# The CPU counterpart of `bench/device/one.sh bits`: a previous braid
# binary against this one on the CPU configurations every parallel
# strategy runs under (one process, DDP, ZeRO-1/2/3, HSDP, tensor
# parallelism with and without sequence parallelism, pipelines under
# 1F1B, ZB (deferred weight gradients) and interleaved, TP × PP, TP × PP
# × ZeRO, accumulation, checkpointing), 6 steps
# from seed 5 with an evaluation every 3. It passes when every saved
# model is byte-identical and every loss, evaluation loss and gradient
# norm is equal. For refactors that must not change a bit (issue 65).
#
#   bash bench/cpu_bits.sh PREV_BINARY [NEW_BINARY]   # NEW default target/release/braid
#
# Make the previous binary with, for example:
#   git worktree add /tmp/prev REV && (cd /tmp/prev && cargo build --release --bins)
set -uo pipefail
prev=${1:?usage: cpu_bits.sh PREV_BINARY [NEW_BINARY]}
new=${2:-$(dirname "$0")/../target/release/braid}
prev=$(realpath "$prev") new=$(realpath "$new")
dir=$(mktemp -d /tmp/cpu-bits.XXXXXX)
trap 'rm -rf "$dir"' EXIT
l4="--model L4-H4-C64"
configs=(
  ""
  "--checkpointing"
  "--accum 2"
  "--nproc-per-node 2"
  "--nproc-per-node 2 --zero 1"
  "--nproc-per-node 2 --zero 2"
  "--nproc-per-node 2 --zero 3"
  "--nproc-per-node 4 --zero 3 --shard-group 2"
  "--nproc-per-node 2 --tp 2"
  "--nproc-per-node 2 --tp 2 --no-sp"
  "--nproc-per-node 2 --pp 2 $l4 --schedule 1f1b"
  "--nproc-per-node 2 --pp 2 $l4 --schedule zb"
  "--nproc-per-node 2 --pp 2 $l4 --schedule interleaved:2"
  "--nproc-per-node 4 --tp 2 --pp 2 $l4"
  "--nproc-per-node 8 --tp 2 --pp 2 $l4 --zero 1"
  "--defer-layers 1 --nproc-per-node 2 --pp 2 $l4 --schedule zb"
)
n=0 same=0
for args in "${configs[@]}"; do
  n=$((n + 1))
  for b in prev new; do
    bin=$prev
    [ $b = new ] && bin=$new
    # shellcheck disable=SC2086 # args is a word list
    timeout 120 "$bin" train --device cpu --steps 6 --seed 5 --eval-every 3 $args \
      --save "$dir/$b-$n.safetensors" --json "$dir/$b-$n.json" > "$dir/$b-$n.txt" 2>&1 ||
      echo "cpu bits $n ($b) failed: $(tail -n 2 "$dir/$b-$n.txt" | tr '\n' ' ')"
  done
  r="$(cmp -s "$dir/prev-$n.safetensors" "$dir/new-$n.safetensors" && echo identical || echo DIFFER) $(
    python3 - "$dir/prev-$n.json" "$dir/new-$n.json" 2>&1 << 'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
L = lambda d: [(s["loss"], s["eval_loss"], s["grad_norm"]) for s in d["steps"]]
print("losses/norms equal" if L(a) == L(b) else "losses DIFFER")
EOF
  )"
  [ "$r" = "identical losses/norms equal" ] && same=$((same + 1))
  echo "cpu bits $n [${args:-one process}]: $r"
done
echo "cpu bits: $same of $n configurations identical (saved model, losses, evaluation losses, norms)"
[ "$same" = "$n" ]
