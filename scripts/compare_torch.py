"""Compares `braid bench --device cuda --json` results with
torch_collectives_bench.py output from the same directory (gpu-bench.sh):
per GPU count, operation and size, the best round of each side, braid's
busbw / PyTorch's busbw and braid's time / PyTorch's time.

PyTorch's all_reduce and broadcast are in place, its all_gather and
reduce_scatter out of place; braid's matching column is compared."""
import glob, json, os, re, sys

out = sys.argv[1] if len(sys.argv) > 1 else "gpu-bench-out"
IN_PLACE = {"all_reduce": True, "broadcast": True, "all_gather": False, "reduce_scatter": False}
braid, torch = {}, {}
for path in glob.glob(os.path.join(out, "braid-*-*.json")):
    n = int(path.split("-")[-2])
    for row in json.load(open(path)):
        side = row["in_place" if IN_PLACE[row["op"]] else "out_of_place"]
        if side is None:
            continue
        key = (n, row["op"], row["bytes"])
        best = braid.get(key)
        if best is None or side["time_us"] < best[0]:
            braid[key] = (side["time_us"], side["busbw"])
pat = re.compile(r"torch-nccl (\S+)\s+world=(\d+) bytes=\s*(\d+) time_us=\s*([\d.]+) algbw=\s*([\d.]+) busbw=\s*([\d.]+)")
for path in glob.glob(os.path.join(out, "torch-*-*.txt")):
    for line in open(path):
        m = pat.search(line)
        if not m:
            continue
        op, n, b, t, _, bb = m.groups()
        key = (int(n), op, int(b))
        best = torch.get(key)
        if best is None or float(t) < best[0]:
            torch[key] = (float(t), float(bb))

def nearest(n, op, b):
    # PyTorch rounds tiny sizes up to one element per rank: match the
    # closest braid size.
    cands = [k for k in braid if k[0] == n and k[1] == op]
    return min(cands, key=lambda k: abs(k[2] - b)) if cands else None

fails = 0
for n in sorted({k[0] for k in torch}):
    print(f"\n### {n} GPUs\n")
    print("| op | bytes | braid µs | torch µs | time ratio | braid busbw | torch busbw | busbw ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for op in ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]:
        for (tn, top, b) in sorted(k for k in torch if k[0] == n and k[1] == op):
            bk = nearest(n, op, b)
            if bk is None:
                continue
            bt, bbw = braid[bk]
            tt, tbw = torch[(tn, top, b)]
            ratio = bbw / tbw if tbw > 0 else float("nan")
            tr = bt / tt
            mark = ""
            if b >= 1 << 20 and ratio < 0.97:
                mark = " ✗"; fails += 1
            if b <= 16 and tr > 1.1:
                mark = " ✗"; fails += 1
            print(f"| {op} | {b} | {bt:.1f} | {tt:.1f} | {tr:.2f} | {bbw:.1f} | {tbw:.1f} | {ratio:.3f}{mark} |")
print(f"\n{fails} row(s) miss the targets (busbw >= 0.97x at >= 1 MB, 8-byte latency <= 1.1x)")
