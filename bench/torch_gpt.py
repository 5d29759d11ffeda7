"""The GPT-2 family model in PyTorch that braid is compared with: the
architecture of ../shared/anchors/torch_gpt2_bench.py (pre-LayerNorm
blocks, tanh GELU, scaled_dot_product_attention with a causal mask, LM head
tied to the token embedding). Shared by make_gpt_reference.py and
torch_gpt2_cpu.py."""
import torch.nn as nn, torch.nn.functional as F
import torch


def make_gpt(L, H, C, V, T):
    class Block(nn.Module):
        def __init__(s):
            super().__init__(); s.ln1 = nn.LayerNorm(C); s.attn = nn.Linear(C, 3 * C); s.proj = nn.Linear(C, C)
            s.ln2 = nn.LayerNorm(C); s.fc = nn.Linear(C, 4 * C); s.fc2 = nn.Linear(4 * C, C)

        def forward(s, x):
            b, t, _ = x.shape
            q, k, v = s.attn(s.ln1(x)).split(C, dim=2)
            q, k, v = (u.view(b, t, H, C // H).transpose(1, 2) for u in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, C)
            x = x + s.proj(y)
            return x + s.fc2(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(s):
            super().__init__(); s.wte = nn.Embedding(V, C); s.wpe = nn.Embedding(T, C)
            s.blocks = nn.ModuleList(Block() for _ in range(L)); s.lnf = nn.LayerNorm(C)

        def forward(s, idx, tgt):
            x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1]))
            for b in s.blocks: x = b(x)
            logits = s.lnf(x) @ s.wte.weight.T
            return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))

    return GPT()
