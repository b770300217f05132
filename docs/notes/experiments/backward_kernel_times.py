"""Where the backward's time goes at D = 192 / 128 and D = 256 (performance notes, entry 138):
device time of each kernel of one backward, flashop against cuDNN, from torch.profiler.

On a Hopper GPU (from the repository root):

    PYTHONPATH=. python docs/notes/experiments/backward_kernel_times.py

bf16, 16384 tokens per batch, H = 2048 // DV; 10 backwards after 5, kernels above 5 us. The
gradients accumulate between backwards (an elementwise add per input, the same for both).
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
import flashop


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for (D, DV, N, causal) in ((192, 128, 4096, False), (192, 128, 4096, True), (192, 128, 16384, False), (192, 128, 16384, True), (256, 256, 16384, False), (256, 256, 16384, True)):
        if True:
            B, H = 16384 // N, 2048 // DV
            q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            fl = 2.5 * 2 * B * H * N * N * (D + DV) / (2 if causal else 1)
            for name in ("flashop", "cudnn"):
                if name == "flashop":
                    out = flashop.attention(q, k, v, causal=causal)
                else:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
                do = torch.randn_like(out)
                for _ in range(5):
                    out.backward(do, retain_graph=True)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        out.backward(do, retain_graph=True)
                    torch.cuda.synchronize()
                tot = 0.0; parts = []
                for e in prof.key_averages():
                    t = e.device_time_total / 10 / 1000 if hasattr(e, "device_time_total") else e.cuda_time_total / 10 / 1000
                    if t > 0.005:
                        parts.append((t, e.key[:60])); tot += t
                parts.sort(reverse=True)
                print(f"D={D}/{DV} N={N} causal={causal} {name}: total {tot:.3f} ms ({fl / tot * 1e-9:.0f} TFLOP/s) | " + " | ".join(f"{n} {t:.3f}" for t, n in parts[:5]), flush=True)


if __name__ == "__main__":
    main()
