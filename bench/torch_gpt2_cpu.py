"""PyTorch's CPU forward + backward throughput for a GPT-2 family model,
the peer of `braid train --fwd-bwd-only` (same architecture as
../shared/anchors/torch_gpt2_bench.py — pre-LN blocks, tanh GELU, SDPA with
a causal mask, tied head — in float32 on the CPU, vocabulary 50257 like
braid's 124M).

    python bench/torch_gpt2_cpu.py --model 124M --B 2 --T 128 --steps 4

Prints the median tokens/s of forward + backward over the timed steps."""
import argparse, os, sys, time, torch, torch.nn as nn
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import make_gpt

p = argparse.ArgumentParser()
p.add_argument("--model", default="124M"); p.add_argument("--B", type=int, default=2)
p.add_argument("--T", type=int, default=128); p.add_argument("--steps", type=int, default=4)
p.add_argument("--warmup", type=int, default=1)
a = p.parse_args()
L, H, C = {"124M": (12, 12, 768), "350M": (24, 16, 1024)}[a.model]
V = 50257


torch.manual_seed(0)
m = make_gpt(L, H, C, V, 1024)
for n_, p_ in m.named_parameters():
    if p_.dim() >= 2: nn.init.normal_(p_, std=0.02)
    elif "ln" in n_ and n_.endswith("weight"): nn.init.ones_(p_)
    else: nn.init.zeros_(p_)
times = []
for step in range(a.warmup + a.steps):
    x = torch.randint(0, V, (a.B, a.T)); y = torch.randint(0, V, (a.B, a.T))
    t0 = time.perf_counter()
    loss = m(x, y); loss.backward()
    dt = time.perf_counter() - t0
    m.zero_grad(set_to_none=True)
    if step >= a.warmup: times.append(dt)
times.sort(); med = times[len(times) // 2]
print(f"torch-cpu {a.model} B={a.B} T={a.T} threads={torch.get_num_threads()} loss={loss.item():.3f} "
      f"fwd+bwd median {a.B * a.T / med:.1f} tokens/s ({med * 1e3:.0f} ms/step)")
