"""Experiment (performance notes, entry 104): the Gluon forward compiled for e4m3 inputs
(gluon_fp8_forward.patch, applied to 6acf3e2: V^T tiles through a descriptor of the
keys-last values, P in e4m3 as the P V wgmma's register operand, the descales per work
item, an EXP16 switch taking P's exp2 two at a time in fp16, and gluon.FWD_FP8_PINGPONG: the
two consumer groups issuing their wgmmas in turn), beside the tl fp8 forward and the bf16
forward, one H200 process per mode:
  python gluon_fp8_forward.py acc                 # relative RMSE against float64, both kernels
  python gluon_fp8_forward.py speed 128,256,64 4096,16384   # the Gluon tile variants
  python gluon_fp8_forward.py exp16 128,256 4096,16384      # exp2 in fp32 or fp16 pairs
  python gluon_fp8_forward.py pingpong                      # groups in turn, or not
TFLOP/s counted as bf16's; 16k tokens per batch, H = 2048 / D. Hopper, triton 3.6; not run
by CI."""
import sys, time, itertools, torch, triton
import flashop
from flashop import config
from flashop._launch import gluon
from flashop.reference import fp8_attention_reference

torch.manual_seed(0)
FP8 = torch.float8_e4m3fn
dev = "cuda"
mode = sys.argv[1] if len(sys.argv) > 1 else "all"
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)


def quant(x):
    ds = (x.abs().amax(dim=(1, 3)).float() / 448).clamp(min=1e-12)
    return (x.float() / ds[:, None, :, None]).to(FP8), ds


def rel(out, ref):
    e = out.double() - ref.double()
    return (e.pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item(), e.abs().max().item()


if mode in ("all", "acc"):
    # accuracy: gluon fp8 vs tl fp8 vs float64 on dequantized
    for D, S, causal, outl in [(128, 4096, False, False), (128, 4096, True, False),
                               (128, 16384, False, False), (64, 4096, False, False),
                               (256, 2048, False, False), (128, 4096, False, True),
                               (128, 1000, True, False), (256, 777, True, False)]:
        B, H = 1, 2
        xs = []
        for _ in range(3):
            x = torch.randn(B, S, H, D, device=dev)
            if outl:
                m = torch.rand(x.shape, device=dev) < 1e-3
                x = x + m * torch.randn(x.shape, device=dev) * 10
            xs.append(x)
        (q, qd), (k, kd), (v, vd) = (quant(x) for x in xs)
        ref, _ = fp8_attention_reference(q, k, v, qd, kd, vd, causal=causal, out_dtype=torch.float64)
        takes = gluon.serves(q, k, v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), causal, 0.1, True)
        o_g = flashop.attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
        with config.override(gluon=False):
            o_t = flashop.attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
        r_g, r_t = rel(o_g, ref), rel(o_t, ref)
        print(f"acc D={D} S={S} causal={causal} outliers={outl} gluon_serves={takes} "
              f"gluon rel={r_g[0]:.2e} max={r_g[1]:.2e} | tl rel={r_t[0]:.2e} max={r_t[1]:.2e}"
              f" | gluon-tl max={ (o_g.float()-o_t.float()).abs().max().item():.2e}", flush=True)


def tflops(ms, B, H, S, D, causal):
    f = 4 * B * H * S * S * D / (2 if causal else 1)
    return f / ms * 1e-9


def grid_inputs(D, S):
    """The grid's bf16 q, k, v (16k tokens per batch, H = 2048 / D) and their e4m3 copies
    with descales: (B, H, (q, k, v), ((q8, qd), (k8, kd), (v8, vd)))."""
    B, H = 16384 // S, 2048 // D
    x = [torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    return B, H, x, [quant(t) for t in x]


VARIANTS = {
    64: [(192, 128, 3, False), (192, 256, 2, False), (128, 128, 3, False), (128, 256, 2, False)],
    128: [(128, 128, 3, False), (128, 128, 4, False), (128, 256, 2, False), (192, 128, 3, False),
          (128, 128, 2, False)],
    256: [(128, 128, 2, True), (128, 128, 2, False), (128, 64, 3, True), (128, 64, 4, False)],
}
if mode in ("all", "speed"):
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 256, 64]
    lens = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1024, 4096, 16384]
    for D in dims:
        for S in lens:
            for causal in (False, True):
                B, H, (q, k, v), ((q8, qd), (k8, kd), (v8, vd)) = grid_inputs(D, S)
                row = {}
                row["bf16"] = triton.testing.do_bench(lambda: flashop.attention(q, k, v, causal=causal))
                call = lambda: flashop.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
                with config.override(gluon=False):
                    row["fp8-tl"] = triton.testing.do_bench(call)
                saved = dict(gluon.FWD_FP8_TILES), set(gluon.FWD_FP8_KV_APART)
                for (bm, bn, st, apart) in VARIANTS[D]:
                    gluon.FWD_FP8_TILES[D] = (bm, bn, st)
                    if apart:
                        gluon.FWD_FP8_KV_APART.add(D)
                    else:
                        gluon.FWD_FP8_KV_APART.discard(D)
                    try:
                        out = call()
                        torch.cuda.synchronize()
                        row[f"g{bm}x{bn}s{st}{'a' if apart else ''}"] = triton.testing.do_bench(call)
                    except Exception as e:
                        row[f"g{bm}x{bn}s{st}{'a' if apart else ''}"] = float("nan")
                        print("  fail", D, bm, bn, st, apart, str(e).splitlines()[0][:200], flush=True)
                    finally:
                        gluon.FWD_FP8_TILES.clear(); gluon.FWD_FP8_TILES.update(saved[0])
                        gluon.FWD_FP8_KV_APART.clear(); gluon.FWD_FP8_KV_APART.update(saved[1])
                # v keys-last (no copy), default tiles
                v8k = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
                row["g-default-vkl"] = triton.testing.do_bench(lambda: flashop.attention(q8, k8, v8k, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd))
                bf = tflops(row["bf16"], B, H, S, D, causal)
                print(f"D={D} S={S} causal={causal} " + " ".join(
                    f"{n}={tflops(ms, B, H, S, D, causal):.0f}" for n, ms in row.items())
                    + f" | best/bf16={max(tflops(ms, B, H, S, D, causal) for n, ms in row.items() if n.startswith('g'))/bf:.2f}", flush=True)

if mode == "exp16":
    import flashop._launch.attention as la
    orig = la._fp8_args
    dims = [int(d) for d in sys.argv[2].split(",")]
    lens = [int(s) for s in sys.argv[3].split(",")]
    for D in dims:
        for S in lens:
            for causal in (False, True):
                B, H, (q, k, v), ((q8, qd), (k8, kd), (v8, vd)) = grid_inputs(D, S)
                v8 = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
                ref = None
                if S == 4096 and D == 128:
                    ref, _ = fp8_attention_reference(q8[:1, :, :2], k8[:1, :, :2], v8[:1, :, :2], qd[:1, :2], kd[:1, :2], vd[:1, :2], causal=causal, out_dtype=torch.float64)
                row = {"bf16": triton.testing.do_bench(lambda: flashop.attention(q, k, v, causal=causal))}
                call = lambda: flashop.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
                accs = []
                for exp in (1, 2):
                    la._fp8_args = (lambda *a, _e=exp: dict(orig(*a), FP8=_e) if orig(*a)["FP8"] else orig(*a))
                    for gl_on in (False, True):
                        with config.override(gluon=gl_on):
                            name = f"{'gluon' if gl_on else 'tl'}-exp{16 if exp == 2 else 32}"
                            try:
                                out = call(); torch.cuda.synchronize()
                                row[name] = triton.testing.do_bench(call)
                                if ref is not None:
                                    accs.append(f"{name} rel={rel(out[:1, :, :2], ref)[0]:.3e}")
                            except Exception as e:
                                row[name] = float("nan")
                                print("  fail", name, str(e)[-300:], flush=True)
                la._fp8_args = orig
                bf = tflops(row["bf16"], B, H, S, D, causal)
                print(f"D={D} S={S} causal={causal} vkl " + " ".join(
                    f"{n}={tflops(ms, B, H, S, D, causal):.0f}" for n, ms in row.items()) + " " + " ".join(accs), flush=True)


if mode == "pingpong":
    for D, S, causal, bf in [(128, 16384, False, True), (128, 16384, True, False),
                             (128, 4096, False, False), (256, 16384, False, False)]:
        B, H, (q, k, v), ((q8, qd), (k8, kd), (v8, vd)) = grid_inputs(D, S)
        v8 = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        call = lambda: flashop.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                         v_descale=vd)
        row = {}
        if bf:
            row["bf16"] = triton.testing.do_bench(
                lambda: flashop.attention(q, k, v, causal=causal), rep=50)
        with config.override(gluon=False):
            row["tl"] = triton.testing.do_bench(call, rep=50)
            o_tl = call()
        for pp in (True, False):
            gluon.FWD_FP8_PINGPONG = pp
            o = call()
            torch.cuda.synchronize()
            row[f"gluon-pp{int(pp)}"] = triton.testing.do_bench(call, rep=50)
            row[f"diff-pp{int(pp)}"] = (o.float() - o_tl.float()).abs().max().item()
        gluon.FWD_FP8_PINGPONG = True
        print(f"D={D} S={S} causal={causal} " + " ".join(
            f"{n}={ms:.2e}" if n.startswith("diff") else f"{n}={tflops(ms, B, H, S, D, causal):.0f}"
            for n, ms in row.items()), flush=True)
