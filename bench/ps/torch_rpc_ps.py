"""PyTorch's RPC parameter server, timed on the CPU: braid's peer for `braid train --ps N`.

PyTorch's parameter-server tutorial pattern (torch.distributed.rpc over
TensorPipe): S parameter-server processes each own a shard of a small GPT-2
style decoder's parameters and that shard's AdamW optimizer; W trainer
processes, each step, pull the current parameters from every server, compute
the next-token cross-entropy loss and its gradients on a batch of random
tokens, and push the gradients back. All S + W processes run on this host,
started by this script (torch.multiprocessing, spawn), CPU only.

    --mode sync   (default) every server waits for the step's W pushes
                  (`@rpc.functions.async_execution` + a torch.futures.Future,
                  the tutorial's batch-update server), applies one AdamW step
                  on the mean gradient, then answers all W pushes.
    --mode async  every push is applied as it arrives (one AdamW step on that
                  trainer's gradient); nobody waits for anybody.

Model: token + position embeddings, --layers pre-LayerNorm blocks (causal
scaled_dot_product_attention, 4x tanh-GELU MLP), final LayerNorm, LM head tied
to the token embedding. The defaults (2 layers, 4 heads, width 64, vocab 256,
seq 64, batch 16) are braid's `tiny` model. Parameters are sharded across the
servers by whole parameter, balanced by element count.

Run:

    python bench/ps/torch_rpc_ps.py                                  # 1 server, 2 trainers, sync, 50 steps
    python bench/ps/torch_rpc_ps.py --mode async --servers 2 --workers 4 --json out.json

Timing: each trainer runs --steps steps; the first --warmup are not timed. A
step is pull + forward + backward + push (until the push is answered). The
summary line gives the median step time (over all trainers' timed steps),
tokens/s summed over trainers (W * batch * seq / median step time) and the
final loss (mean over trainers of their last step's loss). With uniform random
tokens the loss can only fall from about ln(vocab) + a little (5.56 for 256)
to ln(vocab) (5.545); --fixed-batches K cycles each trainer over K fixed
batches instead, so the loss visibly falls (the model memorises them), a check
that the updates reach the trainers. --json FILE writes the summary as JSON.
Exits non-zero with a message on any failure or when --timeout passes.
"""
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU only, in this process and in the spawned ones
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe over localhost

import argparse
import json
import math
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- model

class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, heads, width, vocab, seq):
        super().__init__()
        if width % heads:
            raise ValueError(f"--width {width} is not a multiple of --heads {heads}")
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        with torch.no_grad():  # GPT-2 init: N(0, 0.02) matrices, zero biases, unit LayerNorm
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
                elif "ln" in name and name.endswith("weight"):
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def build_model(a):
    torch.manual_seed(a.seed)  # every process builds the same initial parameters
    return GPT(a.layers, a.heads, a.width, a.vocab, a.seq)


def shard_plan(params, servers):
    """Indices of the parameters each server owns: whole parameters, largest first
    onto the least-loaded server (ties to the lower server), each list in model order."""
    if len(params) < servers:
        raise ValueError(f"{servers} servers for {len(params)} parameters: every server needs one")
    load, owned = [0] * servers, [[] for _ in range(servers)]
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owned[s].append(i)
        load[s] += params[i].numel()
    return [sorted(o) for o in owned]


def ps_name(s):
    return f"ps{s}"


def trainer_name(w):
    return f"trainer{w}"


# ----------------------------------------------------------------------------- server

class ParamServer:
    """One shard: its parameters, its AdamW, and the sync-mode batch of pushes."""

    def __init__(self, a, sid):
        model = build_model(a)
        plan = shard_plan(list(model.parameters()), a.servers)[sid]
        every = list(model.parameters())
        self.params = [nn.Parameter(every[i].detach().clone()) for i in plan]
        self.sizes = [p.numel() for p in self.params]
        self.opt = torch.optim.AdamW(self.params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                     foreach=True)
        self.sync = a.mode == "sync"
        self.workers = a.workers
        self.lock = threading.Lock()
        self.pending = 0  # sync: pushes of the current step received
        self.step = 0  # sync: the step being gathered
        self.acc = None  # sync: sum of the step's flat gradients
        self.done = torch.futures.Future()  # sync: answered when the step's update is applied
        self.updates = 0

    def flat_params(self):
        with self.lock:
            return torch.cat([p.detach().reshape(-1) for p in self.params])

    def apply(self, flat_grad):  # under self.lock
        if flat_grad.numel() != sum(self.sizes):
            raise ValueError(f"gradient of {flat_grad.numel()} elements for a shard of {sum(self.sizes)}")
        for p, g in zip(self.params, flat_grad.split(self.sizes)):
            p.grad = g.view_as(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.updates += 1


_PS = None  # this process's ParamServer (set before rpc.init_rpc, in server processes only)


def ps_pull():
    return _PS.flat_params()


@rpc.functions.async_execution
def ps_push_sync(step, flat_grad):
    """The tutorial's batch-update pattern: every push but the step's last one only
    accumulates and returns the step's future; the last applies the mean and answers all."""
    ps = _PS
    with ps.lock:
        if step != ps.step:
            raise RuntimeError(f"sync push for step {step} while the server gathers step {ps.step}")
        if ps.acc is None:
            ps.acc = flat_grad.clone()
        else:
            ps.acc += flat_grad
        ps.pending += 1
        fut = ps.done
        if ps.pending == ps.workers:
            ps.apply(ps.acc.div_(ps.workers))
            ps.acc, ps.pending, ps.step = None, 0, ps.step + 1
            ps.done = torch.futures.Future()
            fut.set_result(ps.updates)
    return fut


def ps_push_async(step, flat_grad):
    ps = _PS
    with ps.lock:
        ps.apply(flat_grad)
        return ps.updates


# ----------------------------------------------------------------------------- processes

def init_rpc(a, name, rank):
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{a.port}",
        rpc_timeout=a.rpc_timeout,
        num_worker_threads=max(4, 2 * a.workers),
    )
    rpc.init_rpc(name, rank=rank, world_size=a.servers + a.workers, rpc_backend_options=opts)


def run_server(a, sid):
    global _PS
    _PS = ParamServer(a, sid)  # before init_rpc: pushes may arrive as soon as it returns
    init_rpc(a, ps_name(sid), sid)
    rpc.shutdown()  # graceful: returns once every trainer is done


def run_trainer(a, wid, results):
    model = build_model(a)
    params = list(model.parameters())
    plan = shard_plan(params, a.servers)
    servers = [ps_name(s) for s in range(a.servers)]
    init_rpc(a, trainer_name(wid), a.servers + wid)

    gen = torch.Generator().manual_seed(a.seed + 1 + wid)
    fixed = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
             for _ in range(a.fixed_batches)]
    push = ps_push_sync if a.mode == "sync" else ps_push_async
    times, losses = [], []
    for step in range(a.steps):
        tokens = fixed[step % len(fixed)] if fixed else \
            torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
        t0 = time.perf_counter()
        pulls = [rpc.rpc_async(srv, ps_pull, timeout=a.rpc_timeout) for srv in servers]
        with torch.no_grad():
            for idxs, fut in zip(plan, pulls):
                flat = fut.wait()
                at = 0
                for i in idxs:
                    n = params[i].numel()
                    params[i].copy_(flat[at:at + n].view_as(params[i]))
                    at += n
        for p in params:
            p.grad = None
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        pushes = [rpc.rpc_async(srv, push, args=(step, torch.cat([params[i].grad.reshape(-1) for i in idxs])),
                                timeout=a.rpc_timeout)
                  for srv, idxs in zip(servers, plan)]
        torch.futures.wait_all(pushes)
        dt = time.perf_counter() - t0
        lv = loss.item()
        if not math.isfinite(lv):
            raise RuntimeError(f"trainer {wid}: loss {lv} at step {step}")
        losses.append(lv)
        if step >= a.warmup:
            times.append(dt)
    results.put({"worker": wid, "times": times, "losses": losses})
    rpc.shutdown()


def entry(rank, a, results):
    warnings.filterwarnings("ignore", message="You are using a Backend")  # rpc's own gloo use, at init
    torch.set_num_threads(a.threads)
    role = f"ps{rank}" if rank < a.servers else f"trainer{rank - a.servers}"
    try:
        if rank < a.servers:
            run_server(a, rank)
        else:
            run_trainer(a, rank - a.servers, results)
    except BaseException:
        sys.stderr.write(f"torch_rpc_ps: {role} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        raise


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(msg, code=1):
    print(f"torch_rpc_ps: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--servers", type=int, default=1, help="parameter-server processes")
    p.add_argument("--workers", type=int, default=2, help="trainer processes")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per trainer per step")
    p.add_argument("--steps", type=int, default=50, help="steps per trainer, --warmup included")
    p.add_argument("--warmup", type=int, default=5, help="first steps not timed")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--fixed-batches", type=int, default=0,
                   help="cycle each trainer over this many fixed batches (0: fresh random tokens every step)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default max(1, cpu_count // (workers + servers)))")
    p.add_argument("--port", type=int, default=0, help="rendezvous port on 127.0.0.1 (0: a free one)")
    p.add_argument("--rpc-timeout", type=float, default=120.0, help="seconds, every RPC")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON here")
    a = p.parse_args()

    for name in ("servers", "workers", "layers", "heads", "width", "vocab", "seq", "batch"):
        if getattr(a, name) < 1:
            fail(f"--{name} must be at least 1")
    if a.warmup < 0 or a.steps <= a.warmup:
        fail(f"--steps ({a.steps}) must exceed --warmup ({a.warmup}) >= 0")
    if a.fixed_batches < 0:
        fail("--fixed-batches must be >= 0")
    if a.width % a.heads:
        fail(f"--width {a.width} is not a multiple of --heads {a.heads}")
    nparams = sum(q.numel() for q in build_model(a).parameters())
    nparam_tensors = len(list(build_model(a).parameters()))
    if nparam_tensors < a.servers:
        fail(f"--servers {a.servers} but the model has only {nparam_tensors} parameters to shard")
    if a.threads is None:
        a.threads = max(1, (os.cpu_count() or 1) // (a.workers + a.servers))
    if a.port == 0:
        a.port = free_port()

    nprocs = a.servers + a.workers
    spawn = mp.get_context("spawn")
    results = spawn.SimpleQueue()
    got = []
    t_start = time.perf_counter()
    try:
        ctx = mp.start_processes(entry, args=(a, results), nprocs=nprocs, join=False, start_method="spawn")
    except Exception as e:
        fail(f"could not start the {nprocs} processes: {e}")
    problem = None
    try:
        while not ctx.join(timeout=0.5):
            while not results.empty():
                got.append(results.get())
            if time.perf_counter() - t_start > a.timeout:
                problem = (f"the run did not finish within --timeout {a.timeout:g} s (its processes were killed)", 2)
                break
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        i = e.error_index
        role = ps_name(i) if i < a.servers else trainer_name(i - a.servers)
        last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1:] or ["(no message)"]
        where = "its traceback is above; " if isinstance(e, mp.ProcessRaisedException) else ""
        problem = (f"{role} (pid {e.error_pid}) failed: {last[0].strip()} ({where}"
                   f"the other processes were stopped)", 1)
    except KeyboardInterrupt:
        problem = ("interrupted", 130)
    if problem:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
        for proc in ctx.processes:
            proc.join(5)
        fail(*problem)
    while not results.empty():
        got.append(results.get())
    if len(got) != a.workers:
        fail(f"{len(got)} of {a.workers} trainers reported results")
    got.sort(key=lambda r: r["worker"])

    tokens_per_step = a.batch * a.seq
    for r in got:
        med = statistics.median(r["times"])
        print(f"  trainer{r['worker']}: median step {med * 1e3:.2f} ms, {tokens_per_step / med:.0f} tokens/s, "
              f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    every = [t for r in got for t in r["times"]]
    med = statistics.median(every)
    tps = a.workers * tokens_per_step / med
    first = statistics.mean(r["losses"][0] for r in got)
    final = statistics.mean(r["losses"][-1] for r in got)
    print(f"torch-rpc-ps mode={a.mode} servers={a.servers} workers={a.workers} threads={a.threads} "
          f"params={nparams} batch={a.batch} seq={a.seq} steps={a.steps} (warmup {a.warmup}): "
          f"median step {med * 1e3:.2f} ms, {tps:.0f} tokens/s, loss {first:.4f} -> {final:.4f} "
          f"(torch {torch.__version__}, wall {time.perf_counter() - t_start:.1f} s)", flush=True)
    if a.json:
        out = {"mode": a.mode, "servers": a.servers, "workers": a.workers, "steps": a.steps,
               "median_step_ms": med * 1e3, "tokens_per_s": tps, "final_loss": final,
               "threads": a.threads, "torch": torch.__version__,
               # extras, beside the fields above
               "warmup": a.warmup, "batch": a.batch, "seq": a.seq, "layers": a.layers, "heads": a.heads,
               "width": a.width, "vocab": a.vocab, "params": nparams, "lr": a.lr, "seed": a.seed,
               "fixed_batches": a.fixed_batches, "first_loss": first,
               "per_trainer": [{"worker": r["worker"], "median_step_ms": statistics.median(r["times"]) * 1e3,
                                "tokens_per_s": tokens_per_step / statistics.median(r["times"]),
                                "final_loss": r["losses"][-1]} for r in got]}
        try:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
                f.write("\n")
        except OSError as e:
            fail(f"could not write --json {a.json}: {e}")


if __name__ == "__main__":
    main()
