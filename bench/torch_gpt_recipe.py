"""PyTorch's GPT-2 trained with braid's exact recipe, for learning parity
(issue 64): the same tokens (an llm.c u16 shard that `braid data write
--tokens TEXT X.bin` wrote, which `braid train --data X.bin` reads), the
same split (the last tenth held out), held-out loss on the same windows
(the first eval-batches x batch held-out windows of seq tokens, side by
side), training windows side by side, shuffled each epoch, and braid's
defaults for everything else:

- the model of bench/torch_gpt.py (pre-LayerNorm blocks, tanh GELU,
  causal scaled_dot_product_attention, head tied to the token embedding);
- initialisation N(0, 0.02), the two output projections of a block
  N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorms 1 and 0;
- AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices and
  embeddings only, fused;
- the learning rate warmed up linearly ((step + 1) / warmup of the peak),
  then a cosine to a tenth of the peak at the last step;
- the gradients' global norm clipped to 1.0;
- bf16 autocast (braid's bf16 mixed precision: f32 master weights), or
  f32 throughout (TF32 off).

    python bench/torch_gpt_recipe.py --data corpus.bin --model 124M --steps 2000 \
        --batch 16 --seq 1024 --seed 1337 --precision bf16 --json torch-1337.json

The JSON holds every step (`step`, `loss`, `eval_loss` where evaluated,
`lr`, `grad_norm`) as `braid train --json` writes them, so the two read
alike (bench/device/parity.sh draws both)."""
import argparse, json, math, os, sys, time
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import make_gpt, init_like_braid, load_hf_tensors

SIZES = {"124M": (12, 12, 768), "350M": (24, 16, 1024), "774M": (36, 20, 1280), "1558M": (48, 25, 1600)}
SHARD_MAGIC = 20240520


def parse_model(name):
    """A named GPT-2 size, or braid's L<l>-H<h>-C<c>[-V<v>][-T<t>]."""
    if name in SIZES:
        l, h, c = SIZES[name]
        return l, h, c, 50257, 1024
    fields = {p[0].upper(): int(p[1:]) for p in name.split("-")}
    return fields["L"], fields["H"], fields["C"], fields.get("V", 50257), fields.get("T", 1024)


def read_shard(path):
    """The token stream of an llm.c shard (or raw u16 tokens)."""
    head = np.fromfile(path, dtype=np.int32, count=3)
    if len(head) == 3 and head[0] == SHARD_MAGIC:
        return np.fromfile(path, dtype=np.uint16, offset=1024)[: int(head[2])]
    return np.fromfile(path, dtype=np.uint16)


MASK = (1 << 64) - 1


class BraidRng:
    """braid_core::rng::Rng (xoshiro256**, seeded by SplitMix64), for the
    sampler's shuffle: the same windows in the same order as braid."""

    def __init__(self, seed):
        x = seed & MASK
        self.s = []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & MASK
            z = x
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
            self.s.append(z ^ (z >> 31))

    def next_u64(self):
        s = self.s
        rotl = lambda v, k: ((v << k) | (v >> (64 - k))) & MASK
        r = (rotl((s[1] * 5) & MASK, 7) * 9) & MASK
        t = (s[1] << 17) & MASK
        s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t
        s[3] = rotl(s[3], 45)
        return r

    def below(self, n):
        return (self.next_u64() * n) >> 64


def braid_order(n, seed, epoch):
    """braid's DistributedSampler permutation of `n` windows for `epoch`
    (one rank)."""
    order = list(range(n))
    rng = BraidRng(((seed + epoch) & MASK) ^ 0x5A3C9E11D00DF00D)
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="124M")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=None, help="peak (default: braid's for the size)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--precision", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (to try the script without a GPU)")
    ap.add_argument("--init", help="start from these weights (braid's safetensors) instead of a fresh draw")
    ap.add_argument("--order", choices=["braid", "torch"], default="braid",
                    help="each epoch's shuffle: braid's sampler's (the same windows in the same order) "
                         "or torch.randperm")
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = a.device
    L, H, C, V, T = parse_model(a.model)
    model = make_gpt(L, H, C, V, T).to(dev)
    init_like_braid(model, L)
    if a.init:
        from safetensors.torch import load_file
        load_hf_tensors(model, load_file(a.init))
    n_params = sum(p.numel() for p in model.parameters())
    # braid's default peak learning rate by size (braid train's default_lr).
    lr = a.lr or (3e-3 if n_params < 50e6 else 6e-4 if n_params < 200e6 else 3e-4 if n_params < 500e6
                  else 2.5e-4 if n_params < 1e9 else 2e-4)

    tokens = torch.from_numpy(read_shard(a.data).astype(np.int64))
    split = len(tokens) - len(tokens) // 10
    train, held = tokens[:split], tokens[split:]
    n_train = (len(train) - 1) // a.seq
    n_held = (len(held) - 1) // a.seq
    batches_per_epoch = n_train // a.batch

    def windows(part, idx):
        x = torch.stack([part[i * a.seq: (i + 1) * a.seq] for i in idx])
        y = torch.stack([part[i * a.seq + 1: (i + 1) * a.seq + 1] for i in idx])
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    warmup = min(a.warmup, a.steps)

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        span = max(a.steps - warmup, 1)
        coeff = 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / span))
        return 0.1 * lr + coeff * (lr - 0.1 * lr)

    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def evaluate():
        model.eval()
        total = 0.0
        with torch.no_grad(), autocast:
            for k in range(a.eval_batches):
                idx = [(k * a.batch + i) % n_held for i in range(a.batch)]
                total += model(*windows(held, idx)).item()
        model.train()
        return total / a.eval_batches

    print(f"torch recipe: model {a.model} ({n_params / 1e6:.2f}M), {len(tokens)} tokens "
          f"({n_train} training, {n_held} held-out windows of {a.seq}), batch {a.batch}, "
          f"{a.steps} steps, lr {lr}, warmup {warmup}, seed {a.seed}, {a.precision}", flush=True)
    rows, order, started = [], None, time.time()
    for step in range(a.steps):
        epoch, b = divmod(step, batches_per_epoch)
        if b == 0:
            if a.order == "braid":
                order = braid_order(n_train, a.seed, epoch)
            else:
                g = torch.Generator().manual_seed(a.seed + epoch)
                order = torch.randperm(n_train, generator=g).tolist()
        x, y = windows(train, order[b * a.batch:(b + 1) * a.batch])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with autocast:
            loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = {"step": step + 1, "loss": loss.item(), "lr": lr_at(step), "grad_norm": norm,
               "elapsed_s": time.time() - started}
        if a.eval_every > 0 and ((step + 1) % a.eval_every == 0 or step + 1 == a.steps):
            row["eval_loss"] = evaluate()
            print(f"step {step + 1}/{a.steps} | loss {row['loss']:.4f} | eval {row['eval_loss']:.4f}", flush=True)
        rows.append(row)
    with open(a.json, "w") as f:
        json.dump({"system": "pytorch", "model": a.model, "seed": a.seed, "precision": a.precision,
                   "steps": rows}, f)


if __name__ == "__main__":
    main()
