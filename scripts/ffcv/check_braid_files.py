"""Checks that the real ffcv package reads .beton files written by braid with
every value equal: for each FILE it compares what ffcv finds — through its
Reader (every field, payloads by pointer) and through its Loader (every field
its stock decoders take, batch by batch) — with what
`braid data inspect --json --samples all FILE` prints.

Usage (scripts/ffcv/check_braid_files.sh runs it):
    /work/ffcv-venv/bin/python scripts/ffcv/check_braid_files.py BRAID_BINARY FILE...
Exit status 0 when every file agrees; the last run's output is recorded in
scripts/ffcv/check_braid_files.last.txt."""
import hashlib, json, math, os, subprocess, sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../crates/braid-data/tests/fixtures/ffcv"))
from make_fixtures import expected, nested, float_json  # noqa: E402  (ffcv's view of a file)

from ffcv.loader import Loader, OrderOption  # noqa: E402
from ffcv.fields import JSONField  # noqa: E402


def same(a, b):
    """JSON values equal, with nan == nan (both spelled "nan")."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def loader_check(path, braid, order):
    """Reads the file through ffcv's Loader (stock decoders, sequential order)
    and compares with braid's values; returns (fields checked, samples).
    `order`: the field names in file order (the Loader's tuple order)."""
    fields = braid["fields"]
    rows = braid["samples"]
    pipelines, names = {}, []
    for name in order:
        kind = fields[name]
        if kind.split()[1:2] == ["<f2"]:
            pipelines[name] = None  # numba, under ffcv's Loader, has no float16
            continue
        if kind == "rgb_image":
            sizes = {(r[name]["height"], r[name]["width"]) for r in rows}
            modes = {r[name]["mode"] for r in rows}
            if len(sizes) != 1 or modes != {"raw"}:
                pipelines[name] = None  # the simple decoder needs one size
                continue
        names.append(name)
    loader = Loader(path, batch_size=16, num_workers=1, order=OrderOption.SEQUENTIAL,
                    pipelines=pipelines, drop_last=False)
    s = 0
    for batch in loader:
        n = len(batch[0])
        for k, name in enumerate(names):
            kind = fields[name].split()[0]
            col = batch[k]
            for i in range(n):
                want = rows[s + i][name]
                if kind == "int":
                    got = int(col[i][0])
                elif kind == "float":
                    got = float_json(col[i][0])
                elif kind in ("ndarray", "torch_tensor", "tokens"):
                    got = nested(np.asarray(col[i]))
                elif kind == "bytes":
                    got = bytes(col[i][: len(want) // 2]).hex()
                elif kind == "json":
                    got = JSONField.unpack(col[i])
                elif kind == "rgb_image":
                    got = dict(want, sha256=hashlib.sha256(np.ascontiguousarray(col[i]).tobytes()).hexdigest())
                if not same(got, want):
                    raise SystemExit(f"{path}: ffcv's Loader reads sample {s + i} field {name} as {got!r}, braid wrote {want!r}")
        s += n
    if s != len(rows):
        raise SystemExit(f"{path}: ffcv's Loader gave {s} samples, braid wrote {len(rows)}")
    return names, s


def main():
    braid_bin, files = sys.argv[1], sys.argv[2:]
    failed = 0
    for path in files:
        out = subprocess.run([braid_bin, "data", "inspect", "--json", "--samples", "all", path],
                             check=True, capture_output=True, text=True).stdout
        braid = json.loads(out)
        ffcv = expected(path)
        # braid's token fields are NDArray fields to ffcv.
        types = {k: v.replace("tokens ", "ndarray ") for k, v in braid["fields"].items()}
        problems = []
        for key in ("num_samples", "page_size"):
            if braid[key] != ffcv[key]:
                problems.append(f"{key}: braid {braid[key]}, ffcv {ffcv[key]}")
        if types != ffcv["fields"]:
            problems.append(f"fields: braid {types}, ffcv {ffcv['fields']}")
        for s, (b, f) in enumerate(zip(braid["samples"], ffcv["samples"])):
            for name in b:
                if not same(b[name], f[name]):
                    problems.append(f"sample {s} field {name}: braid {b[name]!r}, ffcv {f[name]!r}")
        if problems:
            failed += 1
            print(f"FAIL {path}: " + "; ".join(problems[:5]))
            continue
        names, n = loader_check(path, braid, list(ffcv["fields"]))
        print(f"ok   {os.path.basename(path)}: {n} samples, {len(braid['fields'])} fields equal in ffcv's Reader; "
              f"{len(names)} fields ({', '.join(names)}) equal through ffcv's Loader")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
