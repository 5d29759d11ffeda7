#!/usr/bin/env python3
"""Compares two safetensors files tensor by tensor.

    python3 cmp.py A.safetensors B.safetensors [--tol X]

Reads both files with the standard library only (8-byte little-endian
header length, JSON header, raw little-endian data); numpy, when present,
only speeds up the arithmetic on tensors whose bytes differ (--no-numpy
turns it off). Checks that both hold the same tensor names, shapes and
dtypes, then prints for each file its tensor count, element count and
dtypes, and for the pair: whether they are bit-identical, how many tensors
differ, the largest absolute difference and the tensor (and flat index)
where it occurs.

Exit status: 0 when the largest absolute difference is within --tol
(default 0: bit-identical required, every byte the same; above 0, a NaN
counts as equal to a NaN and as infinitely far from a number), 1 when it is not or the tensors do not match
in names, shapes or dtypes, 2 on bad input (a missing, truncated or
malformed file, an unknown dtype, bad arguments).
"""
import argparse
import array
import json
import math
import mmap
import os
import struct
import sys

# dtype -> (bytes per element, array typecode or a decoder name)
DTYPES = {
    "F64": (8, "d"),
    "F32": (4, "f"),
    "F16": (2, "e"),   # struct, not array: decoded through struct.iter_unpack
    "BF16": (2, "bf16"),
    "I64": (8, "q"),
    "I32": (4, "i"),
    "I16": (2, "h"),
    "I8": (1, "b"),
    "U64": (8, "Q"),
    "U32": (4, "I"),
    "U16": (2, "H"),
    "U8": (1, "B"),
    "BOOL": (1, "B"),
    # Decoded as raw bytes only: compared bit for bit, a difference is
    # reported as infinite.
    "F8_E4M3": (1, None),
    "F8_E5M2": (1, None),
}
FLOATS = {"F64", "F32", "F16", "BF16"}


class BadInput(Exception):
    pass


class SafeTensors:
    """One file: its header's entries and a view of its data."""

    def __init__(self, path):
        self.path = path
        try:
            self.file = open(path, "rb")
        except OSError as e:
            raise BadInput(f"{path}: cannot open: {e.strerror}")
        size = os.fstat(self.file.fileno()).st_size
        if size < 8:
            raise BadInput(f"{path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", self.file.read(8))
        if n > size - 8:
            raise BadInput(f"{path}: header of {n} bytes, but the file has only {size - 8} after the length")
        raw = self.file.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInput(f"{path}: the header is not JSON: {e}")
        if not isinstance(header, dict):
            raise BadInput(f"{path}: the header is not a JSON object")
        self.metadata = header.pop("__metadata__", None)
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.tensors = {}
        for name, e in header.items():
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
                raise BadInput(f"{path}: tensor {name!r}: entry without dtype, shape and data_offsets")
            dt, shape, (a, b) = e["dtype"], e["shape"], e["data_offsets"]
            if dt not in DTYPES:
                raise BadInput(f"{path}: tensor {name!r}: dtype {dt} not known (known: {', '.join(DTYPES)})")
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise BadInput(f"{path}: tensor {name!r}: bad shape {shape}")
            count = math.prod(shape)
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= data_len):
                raise BadInput(f"{path}: tensor {name!r}: data offsets {a}..{b} outside the {data_len} data bytes")
            if b - a != count * DTYPES[dt][0]:
                raise BadInput(
                    f"{path}: tensor {name!r}: {b - a} bytes for {count} elements of {dt} "
                    f"({count * DTYPES[dt][0]} expected)")
            self.tensors[name] = (dt, list(shape), a, b)
        self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else b""

    def data(self, name):
        dt, shape, a, b = self.tensors[name]
        return memoryview(self.map)[self.data_start + a:self.data_start + b]

    def describe(self):
        elems = sum(math.prod(t[1]) for t in self.tensors.values())
        dts = {}
        for t in self.tensors.values():
            dts[t[0]] = dts.get(t[0], 0) + 1
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(dts.items()))
        size = self.data_start + len(self.map)
        return f"{len(self.tensors)} tensors, {elems} elements ({kinds}), {size} bytes"


def decode(dt, buf):
    """The elements of `buf` as Python numbers (floats for float dtypes)."""
    code = DTYPES[dt][1]
    if code == "bf16":
        u = array.array("H")
        u.frombytes(bytes(buf))
        if sys.byteorder == "big":
            u.byteswap()
        f = array.array("I", (x << 16 for x in u))
        return array.array("f", f.tobytes())
    if code == "e":
        return [x[0] for x in struct.iter_unpack("<e", buf)]
    a = array.array(code)
    a.frombytes(bytes(buf))
    if sys.byteorder == "big":
        a.byteswap()
    return a


def diff_python(dt, x, y):
    """(largest absolute difference, its flat index) of two differing tensors."""
    if DTYPES[dt][1] is None:
        i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
        return math.inf, i
    a, b = decode(dt, x), decode(dt, y)
    best, at = -1.0, 0
    isnan = math.isnan
    for i, (p, q) in enumerate(zip(a, b)):
        d = abs(p - q)
        if d != d:  # a NaN on one side or both
            if isnan(p) and isnan(q):
                continue
            d = math.inf
        if d > best:
            best, at = d, i
    return float(best), at


def diff_numpy(np, dt, x, y):
    if DTYPES[dt][1] is None:
        return diff_python(dt, x, y)
    if dt == "BF16":
        a = (np.frombuffer(x, "<u2").astype(np.uint32) << 16).view(np.float32)
        b = (np.frombuffer(y, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        t = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
             "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "u1"}[dt]
        a, b = np.frombuffer(x, t), np.frombuffer(y, t)
    if dt in FLOATS:
        a, b = a.astype(np.float64), b.astype(np.float64)
        d = np.abs(a - b)
        both = np.isnan(a) & np.isnan(b)
        d[both] = 0.0
        d[np.isnan(d)] = np.inf
    else:
        d = np.abs(a.astype(object) - b.astype(object)) if dt == "U64" else np.abs(a.astype(np.int64) - b.astype(np.int64))
    i = int(np.argmax(d))
    return float(d[i]), i


def main(argv):
    p = argparse.ArgumentParser(description="Compare two safetensors files tensor by tensor.")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tol", type=float, default=0.0,
                   help="largest absolute difference accepted (default 0: bit-identical required)")
    p.add_argument("--no-numpy", action="store_true", help="do the arithmetic in pure Python")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    if not args.tol >= 0:
        print(f"cmp.py: --tol {args.tol}: must be 0 or more", file=sys.stderr)
        return 2
    try:
        fa, fb = SafeTensors(args.a), SafeTensors(args.b)
    except BadInput as e:
        print(f"cmp.py: bad input: {e}", file=sys.stderr)
        return 2
    np = None
    if not args.no_numpy:
        try:
            import numpy as np
        except ImportError:
            np = None
    print(f"A {args.a}: {fa.describe()}")
    print(f"B {args.b}: {fb.describe()}")

    only_a = sorted(fa.tensors.keys() - fb.tensors.keys())
    only_b = sorted(fb.tensors.keys() - fa.tensors.keys())
    mismatched = []
    for name in sorted(fa.tensors.keys() & fb.tensors.keys()):
        (da, sa, _, _), (db, sb, _, _) = fa.tensors[name], fb.tensors[name]
        if da != db or sa != sb:
            mismatched.append(f"{name}: A {da}{sa}, B {db}{sb}")
    if only_a or only_b or mismatched:
        for n in only_a[:10]:
            print(f"  only in A: {n}")
        for n in only_b[:10]:
            print(f"  only in B: {n}")
        for m in mismatched[:10]:
            print(f"  differs in dtype or shape: {m}")
        print(f"FAIL: the files do not hold the same tensors ({len(only_a)} only in A, {len(only_b)} only in B, "
              f"{len(mismatched)} with another dtype or shape)")
        return 1

    names = sorted(fa.tensors)
    differing = 0
    worst, worst_name, worst_at = 0.0, None, 0
    for name in names:
        x, y = fa.data(name), fb.data(name)
        if x == y:
            continue
        differing += 1
        dt = fa.tensors[name][0]
        d, i = diff_numpy(np, dt, x, y) if np is not None else diff_python(dt, x, y)
        if worst_name is None or d > worst:
            worst, worst_name, worst_at = d, name, i
    identical = differing == 0
    print(f"bit-identical: {'yes' if identical else 'no'} ({differing} of {len(names)} tensors differ)")
    if identical:
        print("max abs diff: 0")
    else:
        shape = fa.tensors[worst_name][1]
        print(f"max abs diff: {worst:.6g} in {worst_name} {shape} at flat index {worst_at}")
    # At --tol 0 the bits must match (a -0.0 against 0.0, or two NaNs of
    # other payloads, fail although their difference is 0).
    ok = identical if args.tol == 0 else worst <= args.tol
    tol = "bit-identical required" if args.tol == 0 else f"tolerance {args.tol:g}"
    print(f"{'PASS' if ok else 'FAIL'}: {tol}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
