"""Greedy parity with Hugging Face: braid's continuations (the JSON lines of
`braid generate --prompts FILE --temperature 0`, which carry the prompt's
and the continuation's token ids) against GPT2LMHeadModel.generate on the
same weights (braid's safetensors: GPT-2's tensor names and layouts), in
f32 on the GPU, greedy, one prompt at a time and all prompts together
(left-padded, with an attention mask).

    python3 hf_parity.py MODEL.safetensors HEADS BRAID.jsonl [LABEL [TIE]]

Prints one RESULT line per mode: sequences identical, tokens equal up to
the first divergence, and at each first divergence the top two logits' gap
in HF's own logits at that position (a near tie if under TIE, default
1e-4, of the largest logit's size: 2e-2 for braid's bf16 products, their
rounding). Exits 1 when a sequence differs away from a near tie."""
import json, sys, torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

path, heads, lines = sys.argv[1], int(sys.argv[2]), sys.argv[3]
label = sys.argv[4] if len(sys.argv) > 4 else path
TIE = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-4
sd = load_file(path)
layers = len({k.split(".")[1] for k in sd if k.startswith("h.")})
vocab, width = sd["wte.weight"].shape
context = sd["wpe.weight"].shape[0]
cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab,
                 n_positions=context, activation_function="gelu_new",
                 layer_norm_epsilon=1e-5, tie_word_embeddings=True)
m = GPT2LMHeadModel(cfg)
state = {f"transformer.{k}": v for k, v in sd.items()}
state["lm_head.weight"] = sd["wte.weight"]
missing, unexpected = m.load_state_dict(state, strict=False)
missing = [k for k in missing if not k.endswith("attn.bias") and not k.endswith("masked_bias")]
if missing or unexpected:
    sys.exit(f"weights do not fit GPT-2's layout: missing {missing}, unexpected {unexpected}")
m = m.to("cuda", torch.float32).eval()
runs = [json.loads(l) for l in open(lines) if l.strip()]


def gap_at(prompt, upto):
    """HF's top-two logit gap after prompt + upto, and the largest logit."""
    ids = torch.tensor([prompt + upto], device="cuda")
    with torch.no_grad():
        z = m(ids).logits[0, -1].float()
    top = torch.topk(z, 2).values
    return float(top[0] - top[1]), float(top[0].abs())


def compare(mode, outs):
    same = tokens = total = 0
    bad = []
    for r, hf in zip(runs, outs):
        want = r["token_ids"]
        hf = hf[: len(want)]
        total += len(want)
        k = next((i for i, (a, b) in enumerate(zip(want, hf)) if a != b), len(want))
        tokens += k
        if k == len(want) and len(hf) == len(want):
            same += 1
            continue
        gap, size = gap_at(r["prompt_token_ids"], want[:k])
        tie = gap <= TIE * max(size, 1.0)
        bad.append((k, gap, tie))
    ties = sum(1 for b in bad if b[2])
    print(f"RESULT hf-parity {label} {mode}: {same}/{len(runs)} sequences identical, "
          f"{tokens}/{total} tokens before the first divergence; divergences "
          f"{[(k, f'{g:.2e}') for k, g, _ in bad]} ({ties} at a near tie)", flush=True)
    return all(t for _, _, t in bad)


ok = True
with torch.no_grad():
    alone = []
    for r in runs:
        ids = torch.tensor([r["prompt_token_ids"]], device="cuda")
        out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=len(r["token_ids"]), min_new_tokens=len(r["token_ids"]),
                         pad_token_id=0)
        alone.append(out[0, ids.shape[1]:].tolist())
    ok &= compare("batch 1", alone)
    longest = max(len(r["prompt_token_ids"]) for r in runs)
    ids = torch.zeros((len(runs), longest), dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, r in enumerate(runs):
        p = r["prompt_token_ids"]
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    n = max(len(r["token_ids"]) for r in runs)
    out = m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                     min_new_tokens=n, pad_token_id=0)
    ok &= compare(f"batch {len(runs)} left-padded", [o[longest:].tolist() for o in out])
sys.exit(0 if ok else 1)
