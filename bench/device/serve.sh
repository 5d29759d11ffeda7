#!/bin/bash
# Serving on one GPU (nvidia-h100-x1 or nvidia-h200): the f32 GPU decoder
# (crates/braid-model/src/cuda/decode/) checked against the CPU, then
# behind `braid serve --device cuda` under load, beside Hugging Face
# generate(). Phases are arguments, run in order in one call under one
# budget (SERVE_LIMIT seconds, default 540; a run that would pass it is
# skipped):
#
#   bash bench/device/serve.sh check
#     the braid-model library's tests whose names hold "decode" (on a GPU:
#     gpu_decoding_gives_the_cpus_logits, two sequences prefilled
#     together, a fork and 12 batched steps against the CPU's
#     Gpt::decode within 1e-4, and
#     gpu_bad_rows_are_refused_with_what_was_wrong; with the step's plan
#     and the kernels' PTX); it fails if they were skipped. Then a small
#     model trained here (L4-H4-C128-V256-T128, 300 steps) continued
#     greedily by `braid generate` on the GPU and on the CPU, one prompt
#     and a file of four decoded together: the texts compared (the same
#     expected; a near tie in f32 may part them late), their token ids
#     against Hugging Face's GPT2LMHeadModel.generate on the same weights
#     in f32 (bench/device/hf_parity.py: alone and the four left-padded
#     together), and the note that past the context generate decodes on
#     the CPU; then 64 prompts of mixed lengths decoded together on the
#     GPU against each alone (--max-running 1), in f32 (identical) and bf16
#     (at least 99 % of tokens).
#   bash bench/device/serve.sh serve
#     GPT-2 124M (GPT-2's vocabulary; one training step on the GPU, then
#     saved) behind `braid serve --device cuda` (--kv-memory SERVE_KV,
#     default 2G: 64 requests of 256 positions at once), loaded by `braid
#     bench serve` with 64 prompts of 128 tokens and 128 new tokens each,
#     at 1, 8 and 64 requests in flight, then 64 in flight over
#     SERVE_WAVES × 64 requests (default 4; 1: not) for the steady figure
#     (--json into $L), once per
#     --dtype of SERVE_DTYPES (default "bf16 f32"; bf16 runs over a bf16
#     KV cache, f32 over an f32 one, unless BRAID_DECODE_KV says; bf16kv
#     sets BRAID_DECODE_KV=bf16; a setting may add environment
#     assignments and flags after a colon, comma-separated:
#     "bf16kv:BRAID_DECODE_ATTENTION=warps,--step-tokens=2048"), then (the
#     first; SERVE_RATES=none: not) at the
#     Poisson rates SERVE_RATES (default 4,16,64,inf: the serving curve,
#     $L/serve-curve.svg, drawn by braid); then the peer,
#     Hugging Face generate() (.dev/anchors/hf_generate_bench.py 124M:
#     bf16, greedy, prompt 128, 128 new tokens) at batch 1, 8 and 64.
#     braid's steady steps are replayed from CUDA graphs. SERVE_PEER=0:
#     no Hugging Face run.
#
#   bash bench/device/serve.sh profile
#     the same server under BRAID_PROFILE=1 (the decoder's GPU time by
#     phase and the host's time inside and between steps, printed every
#     100 steps), loaded at 1 in flight (8 prompts) and 64 in flight (128
#     prompts), once per setting of PROFILE_RUNS (default "graphs
#     nographs f32": the default, bf16 products and steady steps captured
#     in CUDA graphs; without graphs, BRAID_DECODE_GRAPHS=0; f32 products
#     without graphs; "block" is f32 without graphs with the first
#     attention kernel, BRAID_DECODE_ATTENTION=block; "kvbf16" the default
#     over a bf16 KV cache, "kvbf16nographs" that without graphs, "warps"
#     that with the warp-per-position attention; "nt" the default with
#     BRAID_DECODE_NT=1 and BRAID_DECODE_OVERLAP=1, "ntnographs" that
#     without graphs, "ntcachenographs" that with BRAID_DECODE_QKV_CACHE=1;
#     PROFILE_MODEL=1558m
#     profiles GPT-2 1558M instead of 124M): where a decode
#     step's time goes. Its figures are not the benchmark's (the timing events cost
#     time of their own).
#
#   bash bench/device/serve.sh xl
#     GPT-2 1558M (one bf16 step on the GPU, saved) behind braid serve at 1
#     in flight (16 prompts) and 64 (64 prompts, then SERVE_WAVES × 64),
#     once per setting of
#     XL_SETTINGS (default "bf16"; the syntax of SERVE_DTYPES; XL_KV=f32
#     or bf16 sets the cache, XL_ARGS adds flags of braid serve), then
#     Hugging Face generate() at 1558M (XL_PEER=0: not).
#
#   bash bench/device/serve.sh tests
#     check's first part alone: braid-model's tests matching "decode".
#
#   bash bench/device/serve.sh products
#     the decode step's four products of a layer as a chain over many
#     layers' weights (124M, 1558M) at 1, 4 and 8 rows, by cuBLASLt (its
#     heuristic's choice, then timed over its offers), the skinny kernel
#     (alone and launched overlapping the product ahead), the NT kernel
#     (alone, overlapping with each product started by its weights' size,
#     and under each fixed way of starting, BRAID_DECODE_NT_START's): us a
#     layer and GB/s; then a layer's MLP half as four kernels and as one
#     (BRAID_DECODE_MLP_KERNEL's) at 1 and 8 rows; then the logits
#     (braid-model's ignored test decode_products_timed).
#
#   bash bench/device/serve.sh check serve    # both, in one call
#
# Carry: .dev/braid.gz .dev/commit .dev/built-at .dev/model-tests.gz
# .dev/anchors (bash bench/device/pack.sh makes them; `check` needs
# model-tests, `serve` the anchors for its peer).
cd "$(dirname "$0")/../.." && source bench/device/setup.sh
export BRAID_KERNEL_CACHE=/tmp/kc PYTHONUNBUFFERED=1
LIMIT=${SERVE_LIMIT:-540}
PORT=${SERVE_PORT:-8123}

# Seconds a run may take: at most WANT, and what the call has left; fails
# (the run is skipped) under 20.
budget() {
  local t=$1 left=$((LIMIT - SECONDS))
  [ "$t" -gt "$left" ] && t=$left
  [ "$t" -ge 20 ] || return 1
  echo "$t"
}

# A run: log name, seconds, command. Its output goes to $L/NAME.txt, the
# command first.
run() {
  local name=$1 t=$2
  shift 2
  if ! t=$(budget "$t"); then
    echo "$name: skipped ($((LIMIT - SECONDS)) s left)"
    return 1
  fi
  echo "cmd: $*" > "$L/$name.txt"
  timeout -k 10 "$t" "$@" >> "$L/$name.txt" 2>&1
  local rc=$?
  echo "exit $rc" >> "$L/$name.txt"
  [ $rc = 0 ] || echo "$name: exit $rc: $(grep -v '^exit' "$L/$name.txt" | tail -n 3 | tr '\n' ' ' | cut -c1-300)"
  return $rc
}

# braid-model's tests matching "decode" (the first part of check).
phase_tests() {
  local ok=0 t
  if [ ! -x /tmp/model-tests ]; then
    echo "model-tests: not carried (.dev/model-tests.gz)"
    ok=1
  elif t=$(budget 240); then
    timeout -k 10 "$t" /tmp/model-tests --test-threads 1 --nocapture decode > "$L/model-tests.txt" 2>&1
    echo "exit $?" >> "$L/model-tests.txt"
    echo "== braid-model tests matching decode"
    grep -E "^test |test result|panicked|skipped|compiled to PTX|^exit" "$L/model-tests.txt" | cut -c1-200
    grep -q "^exit 0" "$L/model-tests.txt" || ok=1
    if grep -q "skipped: no GPU" "$L/model-tests.txt"; then
      echo "check: the GPU tests were skipped (no GPU seen)"
      ok=1
    fi
  else
    echo "model-tests: skipped (no time left)"
    ok=1
  fi
  return $ok
}

phase_check() {
  local ok=0 t
  phase_tests || ok=1
  # The GPU decoder through the batcher and the binary: GPU and CPU
  # greedy texts of a small trained model.
  local m=/tmp/serve-small.safetensors
  run train-small 180 "$B" train --device cuda --model L4-H4-C128-V256-T128 --seq 128 --batch 16 \
    --steps 300 --eval-every 0 --log-every 100 --save "$m" || return 1
  printf 'the quick brown fox\nonce upon a time\ndef main():\n    return x\n' > /tmp/serve-prompts.txt
  local d
  # In f32 on both (--dtype f32: the GPU decodes in f32 unless told).
  for d in cuda cpu; do
    run "generate-$d" 60 "$B" generate --load "$m" --device "$d" --dtype f32 \
      --prompt "the quick" --tokens 100 --temperature 0 || ok=1
    run "generate-prompts-$d" 60 "$B" generate --load "$m" --device "$d" --dtype f32 \
      --prompts /tmp/serve-prompts.txt --tokens 60 --temperature 0 || ok=1
  done
  local what
  for what in generate generate-prompts; do
    # The text: every line but the command, the rate line, notes and the exit.
    local a b
    a=$(grep -vE '^(cmd:|generate:|note:|device:|exit )' "$L/$what-cuda.txt")
    b=$(grep -vE '^(cmd:|generate:|note:|device:|exit )' "$L/$what-cpu.txt")
    if [ -n "$a" ] && [ "$a" = "$b" ]; then
      echo "$what: GPU and CPU texts identical ($(echo "$a" | wc -c) bytes)"
    else
      echo "$what: GPU and CPU texts DIFFER"
      diff <(echo "$b") <(echo "$a") | head -n 8 | cut -c1-200
      ok=1
    fi
    echo "  cuda: $(grep -h '^generate:' "$L/$what-cuda.txt")"
    echo "  cpu:  $(grep -h '^generate:' "$L/$what-cpu.txt")"
  done
  # Greedy parity with Hugging Face on the same weights, in f32: braid's
  # token ids (GPU and CPU) against GPT2LMHeadModel.generate, one prompt
  # at a time and the four together (left-padded).
  # The GPU's bf16 products too, against HF in f32: divergences allowed
  # at near ties within bf16's rounding (2e-2 of the logit).
  local how
  for how in cuda:f32:1e-4 cpu:f32:1e-4 cuda:bf16:2e-2; do
    local d=${how%%:*} rest=${how#*:}
    local dt=${rest%%:*} tie=${rest#*:}
    "$B" generate --load "$m" --device "$d" --dtype "$dt" --prompts /tmp/serve-prompts.txt \
      --tokens 60 --temperature 0 > "$L/parity-$d-$dt.jsonl" 2> /dev/null || ok=1
    if t=$(budget 90); then
      timeout -k 10 "$t" python3 bench/device/hf_parity.py "$m" 4 "$L/parity-$d-$dt.jsonl" \
        "small-$d-$dt" "$tie" > "$L/hf-parity-$d-$dt.txt" 2>&1 || ok=1
      grep -hE "^RESULT|Error|error" "$L/hf-parity-$d-$dt.txt" | head -n 4 | cut -c1-250
    fi
  done
  # A request's greedy output does not depend on what else is in the
  # batch: 64 prompts of mixed lengths decoded together against each
  # alone (--max-running 1), on the GPU in f32 (identical expected) and
  # bf16 (at least 99 % of tokens).
  python3 -c "
import random
r = random.Random(7)
words = 'the a of to and in is it that was for on are with as his they at be this from'.split()
for i in range(64):
    print(' '.join(r.choice(words) for _ in range(r.randint(1, 12))))
" > /tmp/serve-prompts64.txt
  for dt in f32 bf16; do
    for how in together alone; do
      local extra=()
      [ $how = alone ] && extra=(--max-running 1)
      if t=$(budget 90); then
        timeout -k 10 "$t" "$B" generate --load "$m" --device cuda --dtype "$dt" \
          --prompts /tmp/serve-prompts64.txt --tokens 60 --temperature 0 "${extra[@]}" \
          > "$L/batch64-$dt-$how.jsonl" 2> "$L/batch64-$dt-$how.err" || ok=1
      fi
    done
    python3 - "$L/batch64-$dt-together.jsonl" "$L/batch64-$dt-alone.jsonl" "$dt" << 'PY' || ok=1
import json, sys
a = [json.loads(l)["token_ids"] for l in open(sys.argv[1])]
b = [json.loads(l)["token_ids"] for l in open(sys.argv[2])]
if len(a) != 64 or len(b) != 64:
    print(f"batch64 {sys.argv[3]}: {len(a)} and {len(b)} lines, 64 expected"); sys.exit(1)
same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
total = sum(max(len(p), len(q)) for p, q in zip(a, b))
parted = [(i, next((k for k, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))))
          for i, (p, q) in enumerate(zip(a, b)) if p != q]
print(f"batch64 {sys.argv[3]}: 64 prompts together against each alone: {same}/{total} tokens "
      f"identical ({100 * same / total:.2f} %), {len(parted)} continuation(s) part"
      + (f" (prompt:token {parted[:8]})" if parted else ""))
ok = same == total if sys.argv[3] == "f32" else same >= 0.99 * total
sys.exit(0 if ok else 1)
PY
  done
  # Past the context (128): decoded on the CPU, said in a note.
  run generate-past 60 "$B" generate --load "$m" --device cuda --prompt "the quick" \
    --tokens 160 --temperature 0 || ok=1
  if grep -q "past the model's context braid generate decodes on the CPU" "$L/generate-past.txt"; then
    echo "generate past the context: on the CPU, with its note"
  else
    echo "generate past the context: no note ($(grep -h '^note' "$L/generate-past.txt"))"
    ok=1
  fi
  return $ok
}

# Waits up to 120 s for /health on PORT while PID runs.
healthy() {
  local pid=$1 i
  for i in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && return 0
    kill -0 "$pid" 2> /dev/null || return 1
    sleep 0.5
  done
  return 1
}

# The saved model of SIZE (124m or 1558m: one training step on the GPU,
# GPT-2's vocabulary), trained the first time; prints its path.
model_file() {
  local size=$1 m=/tmp/m$1.safetensors
  if [ ! -s "$m" ]; then
    case $size in
    124m) run train-124m 180 "$B" train --device cuda --model 124M --tokenizer gpt2 --data random \
      --seq 1024 --batch 4 --steps 1 --eval-every 0 --save "$m" >&2 || return 1 ;;
    1558m) run train-1558m 240 "$B" train --device cuda --model 1558M --tokenizer gpt2 --data random \
      --seq 1024 --batch 1 --steps 1 --eval-every 0 --save "$m" >&2 || return 1 ;;
    esac
  fi
  echo "$m"
}

# A run's setting, DTYPE[:X,Y,...]: bf16kv is bf16 products over a bf16
# KV cache (BRAID_DECODE_KV=bf16); each X is an environment assignment
# (NAME=VALUE) or a flag of braid serve (--name=value). Sets flag (the
# --dtype), envs and args.
setting() {
  local dt=${1%%:*} rest=""
  [[ $1 == *:* ]] && rest=${1#*:}
  flag=$dt envs=() args=()
  [ "$dt" = bf16kv ] && flag=bf16 envs=(BRAID_DECODE_KV=bf16)
  local x
  for x in ${rest//,/ }; do
    case $x in
    --*=*) args+=("${x%%=*}" "${x#*=}") ;;
    *=*) envs+=("$x") ;;
    esac
  done
}

# Starts braid serve with the flags given and the environment assignments
# of the caller's envs array, its output into LOG (the command first);
# sets pid and prints its "braid serve:" lines. Fails, the server stopped,
# without /health within 120 s.
start_serve() {
  local log=$1
  shift
  echo "cmd: ${envs[*]} $B serve $*" > "$log"
  env "${envs[@]}" "$B" serve "$@" >> "$log" 2>&1 &
  pid=$!
  if ! healthy "$pid"; then
    echo "serve: no /health within 120 s ($log): $(tail -n 3 "$log" | tr '\n' ' ')"
    kill "$pid" 2> /dev/null
    wait "$pid" 2> /dev/null
    return 1
  fi
  grep -h "^braid serve:" "$log" | cut -c1-250
}

phase_serve() {
  local m ok=0 c
  m=$(model_file 124m) || return 1
  local dt first=1 flag envs args
  for dt in ${SERVE_DTYPES:-bf16 f32}; do
    setting "$dt"
    local log=$L/serve-124m-${dt//[:=,]/_}.txt
    dt=${dt//[:=,]/_}
    local pid
    start_serve "$log" --device cuda --dtype "$flag" --load "$m" --port "$PORT" \
      --kv-memory "${SERVE_KV:-2G}" "${args[@]}" || return 1
    # 64 in flight once as one wave of 64 (what Hugging Face's batch of 64
    # is), then, SERVE_WAVES > 1 (default 4), kept at 64 in flight over that
    # many waves' requests: the steady figure, which one wave's ramp (64
    # prefills at once) moves by ±20 % from call to call.
    local waves=${SERVE_WAVES:-4} c prompts tag
    for c in 1 8 64 "64x$waves"; do
      prompts=64 tag=$c
      if [[ $c == 64x* ]]; then
        [ "$waves" -gt 1 ] || continue
        prompts=$((64 * waves)) c=64
      fi
      run "bench-serve-$dt-c$tag" 200 "$B" bench serve --url "http://127.0.0.1:$PORT" \
        --num-prompts "$prompts" --input-len 128 --output-len 128 --max-concurrency "$c" \
        --json "$L/bench-serve-$dt-c$tag.json" || ok=1
      echo "== braid serve --device cuda, 124M $dt, concurrency $c, $prompts requests"
      grep -vE '^(cmd:|exit )' "$L/bench-serve-$dt-c$tag.txt" | grep -E "throughput|TTFT|TPOT" | head -n 8 | cut -c1-200
    done
    # The serving curve (the first dtype): Poisson arrivals from light load
    # to saturation, drawn by braid (output tokens/s against the p99 time
    # to first token).
    # SERVE_RATES=none: no sweep.
    if [ "$first" = 1 ] && [ "${SERVE_RATES:-}" != none ]; then
      run bench-serve-sweep 200 "$B" bench serve --url "http://127.0.0.1:$PORT" --num-prompts 64 \
        --input-len 128 --output-len 128 --request-rate "${SERVE_RATES:-4,16,64,inf}" \
        --json "$L/bench-serve-sweep.json" --plot "$L/serve-curve.svg" || ok=1
      echo "== braid serve --device cuda, 124M $dt, the sweep of rates"
      sed -n '/Serving Sweep/,/^$/p' "$L/bench-serve-sweep.txt" | cut -c1-120
    fi
    curl -sf "http://127.0.0.1:$PORT/metrics" > "$L/serve-124m-$dt-metrics.txt" 2>&1
    kill -TERM "$pid" 2> /dev/null
    wait "$pid" 2> /dev/null
    echo "serve $dt: stopped ($(tail -n 1 "$log" | cut -c1-120))"
    first=0
  done
  # The peer: Hugging Face generate() at batch 1, 8, 64, the same size.
  local peer=.dev/anchors/hf_generate_bench.py t
  if [ "${SERVE_PEER:-1}" = 0 ]; then
    echo "hf generate: not run (SERVE_PEER=0)"
  elif [ ! -f "$peer" ]; then
    echo "hf generate: not carried ($peer)"
  elif t=$(budget 240); then
    echo "cmd: python3 $peer 124M" > "$L/hf-generate.txt"
    timeout -k 10 "$t" python3 "$peer" 124M >> "$L/hf-generate.txt" 2>&1
    echo "exit $?" >> "$L/hf-generate.txt"
    echo "== Hugging Face generate(), 124M bf16"
    grep -hE "^RESULT|Error|^exit [^0]" "$L/hf-generate.txt" | cut -c1-200
  else
    echo "hf generate: skipped (no time left)"
  fi
  return $ok
}

phase_profile() {
  local size=${PROFILE_MODEL:-124m} m c a
  m=$(model_file "$size") || return 1
  for a in ${PROFILE_RUNS:-graphs nographs f32}; do
    local log=$L/serve-profile-$size-$a.txt envs=(BRAID_PROFILE=1) dt=bf16
    case $a in
    graphs) ;;
    nographs) envs+=(BRAID_DECODE_GRAPHS=0) ;;
    f32) envs+=(BRAID_DECODE_GRAPHS=0) dt=f32 ;;
    kvbf16) envs+=(BRAID_DECODE_KV=bf16) ;;
    kvbf16nographs) envs+=(BRAID_DECODE_KV=bf16 BRAID_DECODE_GRAPHS=0) ;;
    warps) envs+=(BRAID_DECODE_KV=bf16 BRAID_DECODE_GRAPHS=0 BRAID_DECODE_ATTENTION=warps) ;;
    block) envs+=(BRAID_DECODE_GRAPHS=0 BRAID_DECODE_ATTENTION=block BRAID_DECODE_PICKS=0) dt=f32 ;;
    nt) envs+=(BRAID_DECODE_NT=1 BRAID_DECODE_OVERLAP=1) ;;
    ntnographs) envs+=(BRAID_DECODE_NT=1 BRAID_DECODE_OVERLAP=1 BRAID_DECODE_GRAPHS=0) ;;
    ntcachenographs) envs+=(BRAID_DECODE_NT=1 BRAID_DECODE_OVERLAP=1 BRAID_DECODE_QKV_CACHE=1 BRAID_DECODE_GRAPHS=0) ;;
    *) echo "profile: unknown setting $a"; return 1 ;;
    esac
    local pid
    start_serve "$log" --device cuda --dtype "$dt" --load "$m" --port "$PORT" \
      --kv-memory "${SERVE_KV:-2G}" || return 1
    for c in 1 64; do
      local n=8
      [ "$c" = 64 ] && n=128
      local before
      before=$(grep -c "braid decode profile" "$log")
      run "profile-$size-$a-c$c" 120 "$B" bench serve --url "http://127.0.0.1:$PORT" --num-prompts "$n" \
        --input-len 128 --output-len 128 --max-concurrency "$c"
      echo "== profiled, $size $a, $c in flight: $(grep -hE 'Output token throughput|Mean TPOT' "$L/profile-$size-$a-c$c.txt" | tr -s ' ' | tr '\n' ';')"
      # The last report of this load.
      awk -v skip="$before" '/braid decode profile/{k++} k>skip' "$log" |
        awk '/braid decode profile/{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' | head -n 20 | cut -c1-160
    done
    kill -TERM "$pid" 2> /dev/null
    wait "$pid" 2> /dev/null
  done
}

phase_products() {
  local t
  if [ ! -x /tmp/model-tests ]; then
    echo "products: model-tests not carried (.dev/model-tests.gz)"
    return 1
  fi
  t=$(budget 120) || { echo "products: skipped (no time left)"; return 1; }
  timeout -k 10 "$t" /tmp/model-tests --ignored --nocapture decode_products_timed > "$L/products.txt" 2>&1
  echo "exit $?" >> "$L/products.txt"
  echo "== the decode products, us a layer (GB/s)"
  grep -E "rows|panicked|^exit" "$L/products.txt" | cut -c1-250
  grep -q "^exit 0" "$L/products.txt"
}

# GPT-2 1558M (one bf16 training step on the GPU, then saved) behind
# braid serve in bf16: 1 in flight (16 prompts) and 64 (64 prompts), 128 +
# 128 tokens; then Hugging Face generate() at 1558M.
phase_xl() {
  local m ok=0 c
  m=$(model_file 1558m) || return 1
  local x flag envs args
  # XL_SETTINGS: the settings (as SERVE_DTYPES's) served in turn, "bf16"
  # by default; XL_KV=f32|bf16 sets the cache of each; XL_ARGS: more
  # flags of braid serve (e.g. --step-tokens 2048).
  for x in ${XL_SETTINGS:-bf16}; do
    setting "$x"
    [ -n "${XL_KV:-}" ] && envs+=(BRAID_DECODE_KV="$XL_KV")
    local tag=${x//[:=,]/_}
    local log=$L/serve-1558m-$tag.txt
    local pid
    # shellcheck disable=SC2086
    start_serve "$log" --device cuda --dtype "$flag" --load "$m" --port "$PORT" --kv-memory 8G \
      "${args[@]}" ${XL_ARGS:-} || return 1
    local waves=${SERVE_WAVES:-4} c n ct
    for c in 1 64 "64x$waves"; do
      n=64 ct=$c
      [ "$c" = 1 ] && n=16
      if [[ $c == 64x* ]]; then
        [ "$waves" -gt 1 ] || continue
        n=$((64 * waves)) c=64
      fi
      run "bench-serve-1558m-$tag-c$ct" 150 "$B" bench serve --url "http://127.0.0.1:$PORT" \
        --num-prompts "$n" --input-len 128 --output-len 128 --max-concurrency "$c" \
        --json "$L/bench-serve-1558m-$tag-c$ct.json" || ok=1
      echo "== braid serve --device cuda, 1558M $x, concurrency $c, $n requests"
      grep -vE '^(cmd:|exit )' "$L/bench-serve-1558m-$tag-c$ct.txt" | grep -E "throughput|TTFT|TPOT" | head -n 8 | cut -c1-200
    done
    kill -TERM "$pid" 2> /dev/null
    wait "$pid" 2> /dev/null
  done
  # XL_PEER=0: no Hugging Face run.
  local peer=.dev/anchors/hf_generate_bench.py t
  if [ "${XL_PEER:-1}" != 0 ] && [ -f "$peer" ] && t=$(budget 200); then
    echo "cmd: python3 $peer 1558M" > "$L/hf-generate-1558m.txt"
    timeout -k 10 "$t" python3 "$peer" 1558M >> "$L/hf-generate-1558m.txt" 2>&1
    echo "== Hugging Face generate(), 1558M bf16"
    grep -hE "^RESULT|Error" "$L/hf-generate-1558m.txt" | cut -c1-200
  fi
  return $ok
}

[ $# -gt 0 ] || {
  echo "usage: serve.sh check | tests | serve | profile | xl | products (several in one call)" >&2
  exit 2
}
rc=0
for phase in "$@"; do
  case $phase in
  check) phase_check || rc=1 ;;
  tests) phase_tests || rc=1 ;;
  serve) phase_serve || rc=1 ;;
  profile) phase_profile || rc=1 ;;
  xl) phase_xl || rc=1 ;;
  products) phase_products || rc=1 ;;
  *)
    echo "serve.sh: unknown phase $phase (check, tests, serve, profile, xl, products)" >&2
    rc=2
    ;;
  esac
done
echo "serve.sh $*: ${SECONDS} s"
finish
exit $rc
