# PyTorch scaled_dot_product_attention (causal, bf16) forward and backward
# times per backend at the shapes bench.cu times braid at.
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
def bench(f, reps=21):
    ts=[]
    for _ in range(reps):
        a=torch.cuda.Event(enable_timing=True); b=torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
for (B,H,T,hs) in [(8,32,1024,80),(8,25,1024,64),(8,40,1024,128)]:
    for name, be in [("default",None),("flash",SDPBackend.FLASH_ATTENTION),("cudnn",SDPBackend.CUDNN_ATTENTION),("efficient",SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            q,k,v=[torch.randn(B,H,T,hs,device="cuda",dtype=torch.bfloat16,requires_grad=True) for _ in range(3)]
            ctx = sdpa_kernel([be]) if be else torch.enable_grad()
            with ctx:
                o=F.scaled_dot_product_attention(q,k,v,is_causal=True); do=torch.randn_like(o)
                o.backward(do)
                tf=bench(lambda: F.scaled_dot_product_attention(q,k,v,is_causal=True))
                def fb():
                    o=F.scaled_dot_product_attention(q,k,v,is_causal=True); o.backward(do)
                tfb=bench(fb)
            fl=4.0*B*H*T*T*hs/2
            print(f"torch-{name:10s} B{B} H{H} T{T} hs{hs} | fwd {tf:.3f} ms ({fl/tf/1e9:.0f} TF/s) | bwd {tfb-tf:.3f} ms ({2.5*fl/(tfb-tf)/1e9:.0f} TF/s)")
        except Exception as e:
            print(f"torch-{name} B{B} H{H} hs{hs}: {type(e).__name__}: {str(e)[:120]}")
