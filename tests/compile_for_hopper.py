"""Compile (never run) the `tl` attention kernels and the decoding kernels for Hopper (sm_90)
at the launches their launchers plan, on a machine without a GPU: what the interpreter
cannot show (a helper returning a None pointer, an operation Triton's code generator
refuses, a tile past the shared memory) fails here as it would on the GPU. Run by
tests/test_hopper_compile.py in a process of its own, without TRITON_INTERPRET:

    python tests/compile_for_hopper.py           # every call below; exit status: failures
    python tests/compile_for_hopper.py --planted  # launches that must fail to compile

Triton's active driver is replaced by docs/notes/experiments/compile_sm90.py's stand-in
(it reports sm_90 and launches nothing); each launch the launchers would make is caught and
compiled by the kernel's own ``warmup`` through PTX to a cubin (the wheel's ptxas), and
checked as Inductor sees it: the tensors its analysis of the kernel counts as written are
the kernel's outputs only.
"""

import contextlib
import itertools
import os
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs", "notes", "experiments"))
sys.path.insert(0, ROOT)

import compile_sm90  # noqa: E402  (installs the stand-in driver before flashop's kernels load)
import torch  # noqa: E402

import flashop  # noqa: E402
from flashop import config  # noqa: E402
from flashop._launch import attention, choice, cpu, kvcache, mla, tiles  # noqa: E402
from flashop._launch.options import PLAIN  # noqa: E402


# the launchers' rules that ask for a CUDA device (a Hopper GPU's defaults): given one here
_ON_A_GPU = ((choice, "head_in_parts"), (choice, "_tma_by_default"), (tiles, "splits_dkdv"))


def _on_a_gpu(rule):
    def on_a_gpu(*args, **kwargs):
        args = [torch.device("cuda", 0) if isinstance(a, torch.device) else a for a in args]
        return rule(*args, **kwargs)
    return on_a_gpu


def catch_launches(call) -> list:
    """The (kernel, grid, kwargs) of each launch ``call()`` plans, none launched."""
    caught = []

    def catch(kernel, planned, **per_call):
        caught.append((kernel, planned.grid, {**per_call, **planned.static}))

    def catch_kernel(kernel, grid, **kwargs):
        caught.append((kernel, grid, kwargs))

    with contextlib.ExitStack() as patches:
        patch = lambda module, name, value: patches.enter_context(  # noqa: E731
            mock.patch.object(module, name, value))
        patch(kvcache, "launch_planned", catch)
        patch(mla, "launch_planned", catch)
        patch(attention, "launch_kernel", catch_kernel)
        patch(cpu, "serves", lambda x: False)  # CPU tensors stand for the GPU's here
        for module in (tiles, choice, mla):  # (the stand-in's sm_90)
            patch(module, "is_hopper", lambda device: True)
        for module, name in _ON_A_GPU:
            patch(module, name, _on_a_gpu(getattr(module, name)))
        patches.enter_context(config.override(gluon=False, autotune=False))
        call()
    return caught


def _forward_backward(call):
    def run():
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        if out.requires_grad:
            out.sum().backward()
    return run


def attention_calls():
    """(label, call) for the `tl` forward and backward through the API: head dims 64 to 256
    (192 / 128 too), causal and not, GQA, the modifiers, a float mask with its gradient,
    boolean and float masks at D = 256 (the dQ kernel's staged mask tiles),
    dropout, sinks, chunks, a packed batch, pages, e4m3 inputs (forward only), keys read
    through tensor descriptors, the warp-specialized forward (forced: its default rule reads
    q's device), two query tiles at D = 192 (forced: an autotuning candidate). CPU tensors
    get what a Hopper GPU's would: its tiles, the head dim in parts, the dK/dV kernel's
    parts, tensor descriptors (forward and backward at D = 256). Each call is made as it is
    yielded."""
    bf16, B, S = torch.bfloat16, 2, 256

    def qkv(D, DV, H, H_kv, S_k=S, dtype=bf16):
        grad = dtype != torch.float8_e4m3fn
        return (torch.randn(B, S, H, D, dtype=dtype, requires_grad=grad) if grad else
                torch.empty(B, S, H, D, dtype=dtype),
                torch.randn(B, S_k, H_kv, D, dtype=bf16, requires_grad=grad).to(dtype),
                torch.randn(B, S_k, H_kv, DV, dtype=bf16, requires_grad=grad).to(dtype))

    def dense(label, D, DV, H, H_kv, **options):
        q, k, v = qkv(D, DV, H, H_kv)
        yield label, _forward_backward(lambda: flashop.attention(q, k, v, **options))

    yield from dense("D=64 causal", 64, 64, 4, 4, causal=True)
    yield from dense("D=128 GQA", 128, 128, 4, 2)
    yield from dense("D=192/128 causal", 192, 128, 4, 1, causal=True)
    yield from dense("D=256 causal", 256, 256, 2, 2, causal=True)
    long = tuple(torch.empty(1, 4096, 2, 256, dtype=bf16, requires_grad=True)
                 for _ in range(3))
    yield "D=256 4k keys (tensor descriptors)", _forward_backward(
        lambda: flashop.attention(*long, causal=True))
    yield from dense("D=128 window softcap alibi", 128, 128, 4, 2, causal=True,
                     window_size=(64, 0), softcap=30.0, alibi_slopes=torch.ones(4))
    yield from dense("D=64 dropout", 64, 64, 4, 2, causal=True, dropout_p=0.1)
    yield from dense("D=64 chunks sinks", 64, 64, 4, 2, causal=True, attention_chunk=64,
                     sinks=torch.zeros(4))
    plain = qkv(128, 128, 4, 2)

    def warp_specialized():
        with config.override(warp_specialize=True):
            return flashop.attention(*plain)
    yield "D=128 warp-specialized forward", warp_specialized
    d192 = qkv(192, 128, 4, 1)

    def two_query_tiles():  # (the autotuner's 256-row candidate; the table keeps one tile)
        with tiles.force("fwd", tiles.Tiles(256, 64, 8, 3, split_m=True)):
            return flashop.attention(*d192, causal=True)
    yield "D=192/128 two query tiles, each with the head dim in two", two_query_tiles
    mask = torch.zeros(B, 4, S, S, requires_grad=True)
    yield from dense("D=64 float mask with its gradient", 64, 64, 4, 2, attn_mask=mask)
    yield from dense("D=176/128 float mask with its gradient", 176, 128, 4, 2, causal=True,
                     attn_mask=mask)
    yield from dense("D=256 boolean mask", 256, 256, 4, 2, causal=True,
                     attn_mask=torch.rand(S, S) > 0.5)
    yield from dense("D=256 float mask", 256, 256, 4, 2, attn_mask=torch.randn(S, S))
    e4m3 = qkv(128, 128, 4, 2, dtype=torch.float8_e4m3fn)
    yield "D=128 e4m3 forward", lambda: flashop.attention(*e4m3, causal=True)
    lengths = torch.tensor([0, 100, 256], dtype=torch.int32)
    packed = tuple(x.detach()[0].requires_grad_() for x in qkv(64, 64, 4, 2))
    yield "D=64 packed causal", _forward_backward(lambda: flashop.attention_varlen(
        *packed, lengths, lengths, 156, 156, causal=True))
    pages = torch.randn(8, 64, 2, 64, dtype=bf16)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    yield "D=64 paged prefill", lambda: flashop.attention_varlen(
        packed[0].detach(), pages, pages, lengths, lengths, 156, 156, causal=True,
        block_table=table)


def decoding_calls():
    """(label, call) for the decode and MLA launchers: dense and paged caches, a batch
    index, left padding, appends, one split and several, an fp8 cache; MLA at 32 rows, 16
    and 64 (their tiles differ)."""
    bf16, B, L, S_q = torch.bfloat16, 3, 512, 2
    for kind, paged, extra, splits, append in itertools.product(
            ("decode", "fp8", "mla"), (False, True), (None, "batch_idx", "leftpad"), (1, 4),
            (False, True)):
        if paged and extra:
            continue
        D, DV, H, H_kv = (576, 512, 16, 1) if kind == "mla" else (128, 128, 8, 2)
        cache_dtype = torch.float8_e4m3fn if kind == "fp8" else bf16
        shape = (B * L // 64, 64, H_kv, D) if paged else (B + 1, L, H_kv, D)
        k_cache = torch.empty(shape, dtype=cache_dtype)
        v_cache = (k_cache[..., :DV] if kind == "mla"
                   else torch.empty(shape[:-1] + (DV,), dtype=cache_dtype))
        table = torch.zeros(B, L // 64, dtype=torch.int32) if paged else None
        q = torch.empty(B, S_q, H, D, dtype=bf16)
        k = torch.empty(B, S_q, H_kv, D, dtype=bf16) if append else None
        v = torch.empty(B, S_q, H_kv, DV, dtype=bf16) if append and kind != "mla" else None
        lens = torch.full((B,), L // 2, dtype=torch.int32)
        batch_idx = torch.arange(B, dtype=torch.int32) if extra == "batch_idx" else None
        leftpad = torch.ones(B, dtype=torch.int32) if extra == "leftpad" else None
        label = (f"{kind} {'paged' if paged else 'dense'} {extra or ''} splits={splits}"
                 f"{' append' if append else ''}")
        if kind == "mla":
            yield label, lambda a=(q, k_cache, v_cache, k, v, lens, batch_idx, table, None,
                                   PLAIN[True], splits, leftpad): \
                mla.attention_with_latent_cache(*a)
        else:
            descale = (dict(k_descale=torch.ones(B, H_kv), v_descale=torch.ones(B, H_kv))
                       if kind == "fp8" else {})
            yield label, lambda a=(q, k_cache, v_cache, k, v, lens, batch_idx, table, None,
                                   PLAIN[True], splits, leftpad), d=descale: \
                kvcache.attention_with_kvcache(*a, **d)
    # MLA's 16 rows (one query of 16 heads) and 64 (128 heads): their tiles take 64 keys;
    # a value cache of its own is staged beside the keys (fewer key tiles held)
    for paged, (H, S_q), own in itertools.product(
            (False, True), ((16, 1), (128, 2)), (False, True)):
        shape = (B * L // 64, 64, 1, 576) if paged else (B, L, 1, 576)
        k_cache = torch.empty(shape, dtype=bf16)
        v_cache = torch.empty(shape[:-1] + (512,), dtype=bf16) if own else k_cache[..., :512]
        table = torch.zeros(B, L // 64, dtype=torch.int32) if paged else None
        q = torch.empty(B, S_q, H, 576, dtype=bf16)
        k = torch.empty(B, S_q, 1, 576, dtype=bf16)
        lens = torch.full((B,), L // 2, dtype=torch.int32)
        yield (f"mla {'paged' if paged else 'dense'} H={H} S_q={S_q} append"
               f"{' own values' if own else ''}",
               lambda a=(q, k_cache, v_cache, k, None, lens, None, table, None,
                         PLAIN[S_q > 1], 0, None), own=own:
               mla.attention_with_latent_cache(*a, values_in_keys=not own))


def planted_calls():
    """A launch that must fail: the MLA kernel forced to tiles past Hopper's shared memory
    (64 rows, three stages of 128 keys of 576 dims)."""
    from flashop._launch.decode_tiles import DecodeTiles
    B, L = 2, 512
    pages = torch.empty(B * L // 64, 64, 1, 576, dtype=torch.bfloat16)

    def call():
        with tiles.force(mla.TILE_KIND, DecodeTiles(64, 128, 8, 3)):
            mla.attention_with_latent_cache(
                torch.empty(B, 1, 64, 576, dtype=torch.bfloat16), pages, pages[..., :512],
                None, None, torch.full((B,), L, dtype=torch.int32), None,
                torch.zeros(B, L // 64, dtype=torch.int32), None, PLAIN[False], 1)
    yield "planted: tiles past the shared memory", call


# What each kernel writes. Inductor reads a launch's writes from the kernel's TTIR
# (torch._higher_order_ops.triton_kernel_wrap): a tensor it counts as written beyond these
# would be copied before every launch in a compiled graph, silently.
_OUTPUTS = {
    "attention_fwd_kernel": {"o", "lse", "lse_log2"},
    "attention_fwd_ws_kernel": {"o", "lse", "lse_log2"},
    "attention_bwd_dq_kernel": {"dq", "delta", "dgq", "dattn_mask"},
    "attention_bwd_dkdv_kernel": {"dk", "dv", "dgk", "dq_acc"},
    "keys_last_kernel": {"y"},
    "attention_decode_kernel": {"o", "lse", "o_part", "lse_part"},
    "mla_decode_kernel": {"o", "lse", "o_part", "lse_part"},
    "kvcache_append_kernel": {"k_cache", "v_cache"},
    "attention_decode_merge_kernel": {"o", "lse"},
}


def _writes_outputs_only(res, kernel, name: str, kwargs: dict):
    """``res`` failed where Inductor's analysis of the kernel counts a tensor other than its
    outputs (_OUTPUTS) as written."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    args = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    if hasattr(wrap, "identify_accessed_tensors"):  # torch >= 2.12
        writes = {d.name for d in wrap.identify_accessed_tensors(kernel, args, {})
                  .read_writes.writes}
    else:
        writes = set(wrap.identify_mutated_tensors(kernel, args, {}))
    writes = {w for w in writes if isinstance(args.get(w), torch.Tensor)}
    extra = writes - _OUTPUTS.get(name, set())
    if extra:
        res.ok = False
        res.error = (f"Inductor counts {sorted(extra)} as written (outputs: "
                     f"{sorted(_OUTPUTS.get(name, ()))}): a compiled graph would copy them")
    return res


def _held_as_counted(res, kwargs):
    """``res`` failed where the MLA kernel's shared memory is not what the launcher's
    tile rule counts (mla.held_bytes, up to mla.MARGIN more): the rule would pick tiles
    that do not fit a GPU, or leave out tiles that do."""
    from flashop._launch.decode_tiles import DecodeTiles
    t = DecodeTiles(kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"],
                    kwargs["num_stages"])
    counted = mla.held_bytes(t, 576, 2, kwargs["IS_PAGED"],
                             0 if kwargs["V_IN_K"] else kwargs["DV"])
    if not counted <= res.info["shared"] <= counted + mla.MARGIN:
        res.ok = False
        res.error = (f"shared memory {res.info['shared']} B, where mla.held_bytes counts "
                     f"{counted} B (+ up to {mla.MARGIN})")
    return res


def main(argv) -> int:
    calls = (planted_calls() if "--planted" in argv
             else itertools.chain(attention_calls(), decoding_calls()))
    launches, failures, seen = 0, 0, set()
    for label, call in calls:
        for kernel, grid, kwargs in catch_launches(call):
            name = getattr(kernel, "fn", kernel).__name__
            key = (name, tuple(sorted((k, (v.dtype, v.dim()) if isinstance(v, torch.Tensor)
                                       else v) for k, v in kwargs.items())))
            if key in seen:  # (the same specialization compiled once)
                continue
            seen.add(key)
            launches += 1
            res = compile_sm90.compile_kernel(kernel, grid, kwargs, label=f"{name}: {label}")
            if res.ok and name == "mla_decode_kernel":
                res = _held_as_counted(res, kwargs)
            if res.ok:
                res = _writes_outputs_only(res, kernel, name, kwargs)
            failures += not compile_sm90.report(res)
    print(f"compiled {launches} launches for sm_90, {failures} failed")
    return min(failures, 100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
