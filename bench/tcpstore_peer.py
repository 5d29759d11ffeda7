#!/usr/bin/env python3
"""Peer measurement for `braid store bench`: PyTorch's TCPStore, same ops.

TCPStore's `set` is not acknowledged (the client does not wait for the
server), so its per-op set latency is only the time to hand the bytes to
the kernel; the ops/s figure includes a final acknowledged request and is
the comparable one. braid's `set` waits for the server's reply.

Each client is a separate process (so Python's GIL does not serialise
them) with its own connection; the server is a TCPStore master in the
parent process. Prints the same table as `braid store bench`.

    python3 bench/tcpstore_peer.py --clients 4 --ops 10000 --value-size 32
"""
import argparse
import multiprocessing as mp
import time
from datetime import timedelta


def client(port, cid, op, ops, value, barrier, out):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    prefix = f"bench/{cid}/"
    lat = []
    barrier.wait()
    for i in range(ops):
        key = f"{prefix}k{i % 1024}"
        t = time.perf_counter_ns()
        if op == "set":
            store.set(key, value)
        elif op == "get":
            v = store.get(key)
            assert len(v) == len(value)
        else:
            store.add(prefix + "counter", 1)
        lat.append(time.perf_counter_ns() - t)
    # TCPStore's set does not wait for a reply: one acknowledged request
    # makes sure every set has reached the server before the clock stops.
    store.add(prefix + "sync", 0)
    out.put(lat)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--ops", type=int, default=10000)
    ap.add_argument("--value-size", type=int, default=32)
    a = ap.parse_args()
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = master.port
    value = b"\xab" * a.value_size
    ctx = mp.get_context("fork")
    print(f"# torch TCPStore: {a.clients} client(s), {a.ops} ops each, {a.value_size}-byte values, store at 127.0.0.1:{port}")
    print(f"{'op':>6} {'ops/s':>12} {'p50_us':>10} {'p99_us':>10} {'max_us':>10}")
    for op in ["set", "get", "add"]:
        barrier = ctx.Barrier(a.clients + 1)
        out = ctx.Queue()
        procs = [ctx.Process(target=client, args=(port, c, op, a.ops, value, barrier, out)) for c in range(a.clients)]
        for p in procs:
            p.start()
        barrier.wait()
        start = time.perf_counter()
        lat = []
        for _ in procs:
            lat.extend(out.get())
        wall = time.perf_counter() - start
        for p in procs:
            p.join()
        lat.sort()
        pct = lambda q: lat[round((len(lat) - 1) * q)] / 1e3
        print(f"{op:>6} {len(lat) / wall:>12.0f} {pct(0.5):>10.1f} {pct(0.99):>10.1f} {pct(1.0):>10.1f}")


if __name__ == "__main__":
    main()
