"""Writes the fixture that checks braid's GPT against an independent
implementation: PyTorch's (the model of ../shared/anchors/torch_gpt2_bench.py:
pre-LayerNorm blocks, tanh GELU, scaled_dot_product_attention with a causal
mask, LM head tied to the token embedding), on fixed random weights and
tokens, computed once in float64 on the CPU.

    python bench/make_gpt_reference.py crates/braid-model/tests/fixtures/gpt_reference.safetensors

The file holds the weights under their Hugging Face GPT-2 names prefixed
"param.", the tokens and targets, PyTorch's loss, and its gradients
prefixed "grad." (Conv1D layout [in, out], like the weights)."""
import json, os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import make_gpt, hf_tensors
from safetensors.torch import save_file

L, H, C, V, T, B = 2, 2, 16, 64, 8, 2
torch.manual_seed(20261121)
dt = torch.float64


m = make_gpt(L, H, C, V, T).to(dt)
with torch.no_grad():  # random weights (not GPT-2's init) so every path matters
    for p in m.parameters(): p.copy_(torch.randn_like(p) * 0.3)
idx = torch.randint(0, V, (B, T)); tgt = torch.randint(0, V, (B, T))
loss = m(idx, tgt); loss.backward()

def hf(name_of, get):
    return {name_of + k: v for k, v in hf_tensors(m, get).items()}

tensors = {}
tensors.update(hf("param.", lambda p: p.detach().clone()))
tensors.update(hf("grad.", lambda p: p.grad.detach().clone()))
tensors["tokens"] = idx.to(torch.int64); tensors["targets"] = tgt.to(torch.int64)
tensors["loss"] = loss.detach().reshape(1)
meta = {"braid.config": json.dumps({"n_layer": L, "n_head": H, "n_embd": C, "vocab_size": V, "context": T}),
        "batch": str(B), "torch": torch.__version__}
save_file(tensors, sys.argv[1], metadata=meta)
print(f"loss {loss.item():.12f}; wrote {sys.argv[1]}")
