# Can a memory-bound AdamW step overlap bf16 GEMMs on one H200 (power-capped)?
import torch, time
torch.manual_seed(0)
dev = "cuda"
N = 2_650_000_000 // 4  # a quarter of 2.65B: 10.6 GB of state
p = torch.randn(N, device=dev) * 0.02
g = torch.randn(N, device=dev) * 1e-3
m = torch.zeros(N, device=dev); v = torch.zeros(N, device=dev)
pb = torch.empty(N, device=dev, dtype=torch.bfloat16)
a = torch.randn(8192, 2560, device=dev, dtype=torch.bfloat16)
w = torch.randn(2560, 10240, device=dev, dtype=torch.bfloat16)
steps = [torch.tensor(1.0, device=dev)]
def adam():
    torch._fused_adamw_([p], [g], [m], [v], [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    pb.copy_(p)
def gemms(k):
    for _ in range(k):
        torch.mm(a, w)
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
def timed(f, reps=3):
    best = 1e9
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); best = min(best, time.perf_counter() - t)
    return best * 1e3
K = 60
for _ in range(2): gemms(20); adam()
tg = timed(lambda: gemms(K))
ta = timed(lambda: [adam() for _ in range(4)])
def both(prio_note=""):
    with torch.cuda.stream(s1): gemms(K)
    with torch.cuda.stream(s2): [adam() for _ in range(4)]
tb = timed(both)
print(f"gemms alone {tg:.1f} ms, adamw alone (4 x 2.65B/4 = one 2.65B step) {ta:.1f} ms, serial {tg+ta:.1f} ms, concurrent {tb:.1f} ms: hidden {tg+ta-tb:.1f} ms of {ta:.1f}")
hi = torch.cuda.Stream(priority=-1)
def both_hi():
    with torch.cuda.stream(s1): gemms(K)
    with torch.cuda.stream(hi): [adam() for _ in range(4)]
tb2 = timed(both_hi)
print(f"concurrent, adamw on a high-priority stream {tb2:.1f} ms: hidden {tg+ta-tb2:.1f} ms")
