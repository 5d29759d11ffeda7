#!/bin/bash
# braid plan's first choice for each of Megatron-LM's Table 1 runs
# (Narayanan et al. 2021: GPT from 1.7B on 32 A100s to 1T on 3,072,
# sequences of 2,048, vocabulary 51,200) on the built-in a100 description
# (the paper's DGX A100 nodes of 8), beside the layout the paper ran.
#
#   BRAID=target/release/braid bash bench/plan/megatron.sh OUT
#
# For each row: braid plan --json (OUT/ROW.json, deleted after unless
# KEEP_JSON=1: megabytes each), OUT/summary.json (each row's first five
# layouts that run and the paper's layout as judged), and in OUT/table.md the
# plan's first choice, the paper's layout as the plan predicts it (its
# best form: the paper's TP and PP without ZeRO, any schedule, micro-batch
# and checkpointing; or, where braid refuses every form, its leanest and
# why), and their predicted steps.
# The plan counts braid's engine (fused attention, its memory pre-flight),
# not Megatron-LM's. Runs on a CPU in seconds.
set -euo pipefail
OUT=${1:?usage: megatron.sh OUT}
BRAID=${BRAID:-braid}
mkdir -p "$OUT"
# heads width layers TP PP GPUs batch TFLOP/s (the paper's Table 1)
ROWS="24 2304 24 1 1 32 512 137
32 3072 30 2 1 64 512 138
32 4096 36 4 1 128 512 142
48 6144 40 8 1 256 1024 135
64 8192 48 8 2 512 1536 138
80 10240 60 8 4 1024 1792 140
96 12288 80 8 8 1536 2304 148
128 16384 96 8 16 1920 2160 155
128 20480 105 8 35 2520 2520 163
160 25600 128 8 64 3072 3072 163"
echo "$ROWS" | while read -r h c l tp pp gpus batch tflops; do
  model="L$l-H$h-C$c-V51200-T2048"
  echo "== $model on $gpus GPUs, global batch $batch (paper: --tp $tp --pp $pp, $tflops TFLOP/s)"
  start=$(date +%s.%N)
  "$BRAID" plan --model "$model" --gpus "$gpus" --nodes $((gpus / 8)) --global-batch "$batch" \
    --seq 2048 --hardware a100 --json > "$OUT/$model.json"
  echo "  answered in $(echo "$(date +%s.%N) - $start" | bc) s"
  echo "$model $gpus $batch $tp $pp $tflops" >> "$OUT/rows.txt"
done
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def flags(l, sched):
    f = []
    if l["tp"] > 1: f.append(f"--tp {l['tp']}")
    if l["pp"] > 1: f.append(f"--pp {l['pp']} --schedule {sched} --micro-batches {l['micro_batches']}")
    elif l["micro_batches"] > 1: f.append(f"--accum {l['micro_batches']}")
    if l["zero"]: f.append(f"--zero {l['zero']}")
    if l["shard_group"]: f.append(f"--shard-group {l['shard_group']}")
    if l["offload"]: f.append("--offload optimizer")
    if l["checkpointing"]: f.append("--checkpointing")
    return f"data {l['dp']} x micro-batch {l['micro_batch']}: " + (" ".join(f) or "plain data parallel")
summary = []
lines = ["| model, GPUs, global batch | paper's layout, TFLOP/s | plan's first choice | its step | the paper's TP × PP as the plan counts it | its step | paper's ÷ first |",
         "|---|---|---|---:|---|---:|---:|"]
for row in open(os.path.join(out, "rows.txt")):
    model, gpus, batch, tp, pp, tflops = row.split()
    tp, pp = int(tp), int(pp)
    d = json.load(open(os.path.join(out, model + ".json")))
    runs = [x for x in d["layouts"] if x["prediction"]]
    first = runs[0] if runs else None
    theirs = [x for x in d["layouts"] if x["layout"]["tp"] == tp and x["layout"]["pp"] == pp and x["layout"]["zero"] == 0]
    ran = [x for x in theirs if x["prediction"]]
    name = f"{d['params'] / 1e9:.1f}B, {gpus}, {batch}"
    paper = f"TP {tp} × PP {pp}, {tflops}"
    if first:
        f1 = f"{flags(first['layout'], first['schedule'])} ({(first['states_bytes'] + first['activation_bytes']) / 2**30:.1f} GiB)"
        s1 = f"{first['prediction']['step_s']:.2f} s"
    else:
        f1, s1 = "none runs", "—"
    if ran:
        best = ran[0]
        f2 = f"{flags(best['layout'], best['schedule'])} ({(best['states_bytes'] + best['activation_bytes']) / 2**30:.1f} GiB)"
        s2 = f"{best['prediction']['step_s']:.2f} s"
        ratio = f"{best['prediction']['step_s'] / first['prediction']['step_s']:.2f}×" if first else "—"
    else:
        # The leanest of them, and why even it is refused.
        memory = [x for x in theirs if "GiB per GPU" in (x["refused"] or "")] or theirs
        lean = min(memory, key=lambda x: x["states_bytes"] + x["activation_bytes"], default=None)
        why = f"{flags(lean['layout'], lean['schedule'])}: {lean['refused']}" if lean else "not enumerated"
        f2, s2, ratio = "refused, even " + why, "—", "—"
    lines.append(f"| {name} | {paper} | {f1} | {s1} | {f2} | {s2} | {ratio} |")
    summary.append({"model": model, "gpus": int(gpus), "global_batch": int(batch),
                    "paper": {"tp": tp, "pp": pp, "tflops": float(tflops)},
                    "first_five": runs[:5], "papers_layout": ran[:1] if ran else [lean]})
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
[ "${KEEP_JSON:-0}" = 1 ] || rm -f "$OUT"/L*.json
