"""The GPT-2 family model in PyTorch that braid is compared with: the
architecture of ../shared/anchors/torch_gpt2_bench.py (pre-LayerNorm
blocks, tanh GELU, scaled_dot_product_attention with a causal mask, LM head
tied to the token embedding), and its tensors under Hugging Face GPT-2's
names (what braid's safetensors files hold). Shared by
make_gpt_reference.py, torch_gpt2_cpu.py, torch_gpt_recipe.py and
torch_one_step.py."""
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
            x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in s.blocks: x = b(x)
            logits = s.lnf(x) @ s.wte.weight.T
            return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))

    return GPT()


def hf_tensors(m, get):
    """The model's tensors under Hugging Face GPT-2 names (Conv1D weights
    [in, out], as braid stores them): `get` maps each parameter to what is
    stored (its value, its gradient)."""
    out = {"wte.weight": get(m.wte.weight), "wpe.weight": get(m.wpe.weight),
           "ln_f.weight": get(m.lnf.weight), "ln_f.bias": get(m.lnf.bias)}
    for i, b in enumerate(m.blocks):
        pairs = [("ln_1", b.ln1, False), ("attn.c_attn", b.attn, True), ("attn.c_proj", b.proj, True),
                 ("ln_2", b.ln2, False), ("mlp.c_fc", b.fc, True), ("mlp.c_proj", b.fc2, True)]
        for n, mod, linear in pairs:
            w = get(mod.weight)
            out[f"h.{i}.{n}.weight"] = w.T.contiguous() if linear else w
            out[f"h.{i}.{n}.bias"] = get(mod.bias)
    return out


def init_like_braid(model, n_layer):
    """braid's GPT-2 initialisation (braid-model's Params::init_gpt2):
    N(0, 0.02), a block's two output projections N(0, 0.02 / sqrt(2 L)),
    biases 0, LayerNorms 1 and 0."""
    import math
    resid = 0.02 / math.sqrt(2 * n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("lnf"):
                if name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
            elif name.endswith("proj.weight") or name.endswith("fc2.weight"):
                p.normal_(0.0, resid)
            else:
                p.normal_(0.0, 0.02)


def load_hf_tensors(m, tensors):
    """Sets the model's parameters from Hugging Face GPT-2-named tensors
    (what braid saves: Conv1D weights [in, out])."""
    with torch.no_grad():
        m.wte.weight.copy_(tensors["wte.weight"]); m.wpe.weight.copy_(tensors["wpe.weight"])
        m.lnf.weight.copy_(tensors["ln_f.weight"]); m.lnf.bias.copy_(tensors["ln_f.bias"])
        for i, b in enumerate(m.blocks):
            pairs = [("ln_1", b.ln1, False), ("attn.c_attn", b.attn, True), ("attn.c_proj", b.proj, True),
                     ("ln_2", b.ln2, False), ("mlp.c_fc", b.fc, True), ("mlp.c_proj", b.fc2, True)]
            for n, mod, linear in pairs:
                w = tensors[f"h.{i}.{n}.weight"]
                mod.weight.copy_(w.T if linear else w)
                mod.bias.copy_(tensors[f"h.{i}.{n}.bias"])
