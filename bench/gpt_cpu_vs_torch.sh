#!/usr/bin/env bash
# Forward + backward throughput of a GPT-2 model on this machine's CPUs:
# braid vs PyTorch, alternating, ROUNDS times each.
#   PY=/path/to/python bench/gpt_cpu_vs_torch.sh [MODEL=124M] [B=2] [T=128] [ROUNDS=2]
set -u -o pipefail
MODEL=${1:-124M}; B=${2:-2}; T=${3:-128}; ROUNDS=${4:-2}
PY=${PY:-python3}
BRAID=${BRAID:-target/release/braid}
for r in $(seq 1 "$ROUNDS"); do
  echo "--- round $r"
  $BRAID train --model "$MODEL" --tokenizer gpt2 --batch "$B" --seq "$T" --steps 5 \
    --fwd-bwd-only --eval-every 0 --log-every 1 | grep -E "forward\+backward|^step +1/"
  $PY "$(dirname "$0")/torch_gpt2_cpu.py" --model "$MODEL" --B "$B" --T "$T" --steps 4
done
