"""PyTorch's CPU forward + backward throughput for a GPT-2 family model,
the peer of `braid train --fwd-bwd-only` (same architecture as
../shared/anchors/torch_gpt2_bench.py — pre-LN blocks, tanh GELU, SDPA with
a causal mask, tied head — in float32 on the CPU, vocabulary 50257 like
braid's 124M).

    python bench/torch_gpt2_cpu.py --model 124M --B 2 --T 128 --steps 4

Prints the median tokens/s of forward + backward over the timed steps."""
import argparse, time, torch, torch.nn as nn, torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--model", default="124M"); p.add_argument("--B", type=int, default=2)
p.add_argument("--T", type=int, default=128); p.add_argument("--steps", type=int, default=4)
p.add_argument("--warmup", type=int, default=1)
a = p.parse_args()
L, H, C = {"124M": (12, 12, 768), "350M": (24, 16, 1024)}[a.model]
V = 50257

class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.ln1 = nn.LayerNorm(C); s.attn = nn.Linear(C, 3 * C); s.proj = nn.Linear(C, C)
        s.ln2 = nn.LayerNorm(C); s.fc = nn.Linear(C, 4 * C); s.fc2 = nn.Linear(4 * C, C)
    def forward(s, x):
        B, T, _ = x.shape
        q, k, v = s.attn(s.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + s.proj(y)
        return x + s.fc2(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))

class GPT(nn.Module):
    def __init__(s):
        super().__init__(); s.wte = nn.Embedding(V, C); s.wpe = nn.Embedding(1024, C)
        s.blocks = nn.ModuleList(Block() for _ in range(L)); s.lnf = nn.LayerNorm(C)
    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1]))
        for b in s.blocks: x = b(x)
        logits = s.lnf(x) @ s.wte.weight.T
        return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))

torch.manual_seed(0)
m = GPT()
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
