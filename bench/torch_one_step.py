"""One step of braid against PyTorch on the same weights and batch (issue
64's one-step check, run on a GPU by bench/device/parity.sh onestep):

1. PyTorch initialises the model as braid does and writes it as braid's
   safetensors (Hugging Face GPT-2 names); the batch is the first tokens
   of a token shard (or random ones), written as a shard of exactly one
   batch of training windows, so that braid's sampler can pick no other;
2. braid trains one step from them (`--load`, `--data`, `--steps 1`),
   writing the step's gradients (BRAID_DUMP_GRADS) and its parameters
   after the AdamW update (`--save`);
3. PyTorch computes the same step in f32 (TF32 off) and under bf16
   autocast, and the two are compared tensor by tensor, as
   ||braid - torch|| / ||torch||: in f32 within --f32-tol (1e-5); in bf16
   within --bf16-factor (2) times PyTorch's own bf16 error against its
   f32 step ("within bf16's rounding").

    python bench/torch_one_step.py --braid /tmp/braid --dir /tmp/onestep \
        --model 124M --data corpus.bin --precision bf16

Exits 1 when a comparison fails; prints every tensor kind's error."""
import argparse, json, math, os, subprocess, sys
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import make_gpt, hf_tensors, init_like_braid
from torch_gpt_recipe import parse_model, read_shard, SHARD_MAGIC
from safetensors.torch import save_file, load_file


def write_shard(path, tokens):
    head = np.zeros(256, dtype=np.int32)
    head[0], head[1], head[2] = SHARD_MAGIC, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(head.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def one_batch_tokens(batch, seq):
    """A token count whose training part (all but the last tenth) holds
    exactly `batch` windows of `seq`, and its held-out part one (braid
    wants one); there is one for a batch of 9 or more."""
    for n in range(batch * seq + 1, 2 * (batch + 1) * seq * 10 // 9):
        if (n - n // 10 - 1) // seq == batch and (n // 10 - 1) // seq >= 1:
            return n
    sys.exit(f"no token count gives exactly {batch} training windows of {seq} and a held-out one: "
             f"use a batch of 9 or more")


def rel(a, b):
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-30)


def kind(name):
    for k in ["wte", "wpe", "ln_f", "ln_1", "ln_2", "c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]:
        if k in name:
            return k
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--braid", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model", default="124M")
    ap.add_argument("--data", help="a token shard; default: random tokens")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--precision", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--f32-tol", type=float, default=1e-5)
    ap.add_argument("--bf16-factor", type=float, default=2.0)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(a.seed)
    L, H, C, V, T = parse_model(a.model)
    model = make_gpt(L, H, C, V, T)
    init_like_braid(model, L)
    weights = os.path.join(a.dir, "w.safetensors")
    save_file({k: v.contiguous() for k, v in hf_tensors(model, lambda p: p.detach().clone()).items()},
              weights, metadata={"format": "pt", "braid.config": json.dumps(
                  {"n_layer": L, "n_head": H, "n_embd": C, "vocab_size": V, "context": T})})
    n = one_batch_tokens(a.batch, a.seq)
    if a.data:
        tokens = read_shard(a.data)[:n].astype(np.int64)
    else:
        tokens = np.random.default_rng(a.seed).integers(0, V, n)
    data = os.path.join(a.dir, "batch.bin")
    write_shard(data, tokens)

    # braid's step.
    grads_path, after_path = os.path.join(a.dir, "g.safetensors"), os.path.join(a.dir, "after.safetensors")
    cmd = [a.braid, "train", "--load", weights, "--data", data, "--tokenizer", "gpt2",
           "--batch", str(a.batch), "--seq", str(a.seq), "--steps", "1", "--warmup", "1",
           "--lr", str(a.lr), "--eval-every", "0", "--save", after_path, "--device", a.device,
           "--precision", a.precision]
    env = dict(os.environ, BRAID_DUMP_GRADS=grads_path)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout, r.stderr)
        sys.exit(f"braid failed: {' '.join(cmd)}")
    braid_grads, braid_after = load_file(grads_path), load_file(after_path)

    # PyTorch's step, f32 and bf16, from the same weights and windows.
    t = torch.from_numpy(tokens)
    split = n - n // 10
    x = torch.stack([t[i * a.seq:(i + 1) * a.seq] for i in range(a.batch)]).to(a.device)
    y = torch.stack([t[i * a.seq + 1:(i + 1) * a.seq + 1] for i in range(a.batch)]).to(a.device)
    assert (a.batch * a.seq) < split

    def torch_step(precision):
        m = make_gpt(L, H, C, V, T)
        m.load_state_dict(model.state_dict())
        m = m.to(a.device)
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = m(x, y)
        loss.backward()
        grads = {k: v.float().cpu() for k, v in hf_tensors(m, lambda p: p.grad.detach().clone()).items()}
        decay = [p for p in m.parameters() if p.dim() >= 2]
        rest = [p for p in m.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        after = {k: v.float().cpu() for k, v in hf_tensors(m, lambda p: p.detach().clone()).items()}
        return loss.item(), grads, after

    before = {k: v.float() for k, v in hf_tensors(model, lambda p: p.detach().clone()).items()}
    loss32, g32, a32 = torch_step("f32")
    loss16, g16, a16 = torch_step("bf16")
    ref_g, ref_a = (g32, a32)

    def errors(grads, after):
        by = {}
        for k in ref_g:
            e = by.setdefault(kind(k), [0.0, 0.0, 0.0, 0.0])
            d = (grads[k].double() - ref_g[k].double())
            e[0] += d.pow(2).sum().item(); e[1] += ref_g[k].double().pow(2).sum().item()
            u, u_ref = after[k].double() - before[k].double(), ref_a[k].double() - before[k].double()
            e[2] += (u - u_ref).pow(2).sum().item(); e[3] += u_ref.pow(2).sum().item()
        return {k: (math.sqrt(v[0] / max(v[1], 1e-60)), math.sqrt(v[2] / max(v[3], 1e-60))) for k, v in by.items()}

    ours = errors(braid_grads, braid_after)
    theirs = errors(g16, a16)
    print(f"one step of {a.model}, batch {a.batch} x {a.seq}, {a.precision}: torch loss f32 {loss32:.6f}, "
          f"bf16 {loss16:.6f}")
    print(f"{'tensors':<12} {'braid grad err':>15} {'torch-bf16 grad err':>20} {'braid update err':>17} "
          f"{'torch-bf16 update err':>22}")
    failed = []
    for k in ours:
        (g, u), (tg, tu) = ours[k], theirs[k]
        print(f"{k:<12} {g:>15.3e} {tg:>20.3e} {u:>17.3e} {tu:>22.3e}")
        if a.precision == "f32":
            if g > a.f32_tol:
                failed.append(f"{k}: gradients {g:.3e} > {a.f32_tol}")
            if u > 100 * a.f32_tol:
                failed.append(f"{k}: update {u:.3e} > {100 * a.f32_tol}")
        else:
            if g > a.bf16_factor * tg:
                failed.append(f"{k}: gradients {g:.3e} > {a.bf16_factor} x torch bf16's {tg:.3e}")
            if u > a.bf16_factor * max(tu, 1e-3):
                failed.append(f"{k}: update {u:.3e} > {a.bf16_factor} x torch bf16's {tu:.3e}")
    print("errors are ||x - torch f32|| / ||torch f32|| per kind of tensor; updates are after - before")
    if failed:
        # Where it goes wrong: the worst tensors of the failing kinds, and
        # the worst one's elements that differ by far more than the rest.
        bad = {f.split(":")[0] for f in failed}
        worst = sorted(((rel(braid_grads[k], ref_g[k]), k) for k in ref_g if kind(k) in bad), reverse=True)
        for e, k in worst[:8]:
            d = (braid_grads[k].double() - ref_g[k].double()).abs().flatten()
            typical = d.median().item()
            far = (d > 100 * max(typical, 1e-30)).nonzero().flatten().tolist()
            print(f"  {k}: gradient error {e:.3e}; braid norm {braid_grads[k].norm():.4e}, torch "
                  f"{ref_g[k].norm():.4e}; {len(far)} of {d.numel()} elements off by over 100x the median "
                  f"difference{': ' + str(far[:12]) if far else ''}")
        print("FAILED:\n  " + "\n  ".join(failed))
        sys.exit(1)
    print(f"one-step check passed ({a.precision})")


if __name__ == "__main__":
    main()
