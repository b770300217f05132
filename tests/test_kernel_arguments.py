"""The launchers' kernel arguments: a tensor a call does not have is passed as None, and the
compile-time flag that guards its reads says so (the flag is derived from the tensor), in
every launch of the forward, backward and decoding kernels."""

from unittest import mock

import pytest
import torch

import flashop
from flashop._launch import attention as launch_attention, kvcache as launch_kvcache
from flashop._launch import mla as launch_mla
from helpers import DEVICE, Case, make_inputs, make_modifiers, replayed_launches

# each optional tensor argument of the tl kernels and the flag that says it is there
GUARDS = {"alibi": "HAS_ALIBI", "g_cum": "HAS_GATE", "attn_mask": "ATTN_MASK_KIND",
          "sinks": "HAS_SINK", "dropout_seed": "DROPOUT", "cu_seqlens_q": "IS_VARLEN",
          "cu_seqlens_k": "IS_VARLEN", "dgq": "HAS_GATE", "dgk": "HAS_GATE",
          "dq_acc": "DQ_ATOMIC", "dattn_mask": "ATTN_MASK_GRAD",
          "cache_batch_idx": "HAS_BATCH_IDX", "block_table": "IS_PAGED", "o_part": "SPLIT",
          "lse_part": "SPLIT", "cache_leftpad": "HAS_LEFTPAD", "rotary_cos": "ROTARY_DIM",
          "rotary_sin": "ROTARY_DIM"}


# the decoding kernels' alone
_CACHE_ONLY = ("cache_batch_idx", "o_part", "lse_part", "cache_leftpad", "rotary_cos",
               "rotary_sin")


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))


def _record(calls):
    """Record every kernel launch's arguments (by kernel name) while ``calls()`` runs."""
    launches = []
    launch_kernel, launch_planned = launch_attention.launch_kernel, launch_kvcache.launch_planned

    def kernel_launch(kernel, grid, **kwargs):
        launches.append((_name(kernel), kwargs))
        return launch_kernel(kernel, grid, **kwargs)

    def planned_launch(kernel, planned, **per_call):
        launches.append((_name(kernel), {**per_call, **planned.static}))
        return launch_planned(kernel, planned, **per_call)

    with mock.patch.object(launch_attention, "launch_kernel", kernel_launch), \
            mock.patch.object(launch_kvcache, "launch_planned", planned_launch), \
            mock.patch.object(launch_mla, "launch_planned", planned_launch), \
            replayed_launches(lambda kernel, kwargs: launches.append((_name(kernel), kwargs))):
        calls()
    return launches


def _attention_calls():
    plain = Case(B=1, S_q=20, S_k=33, H_kv=1, G=2, D=16, DV=16, dtype=torch.float32)
    every = Case(B=2, S_q=30, S_k=41, H_kv=1, G=2, D=16, DV=16, dtype=torch.float32,
                 causal=True, window_size=(12, 0), softcap=4.0, alibi=(2, 2),
                 gate=torch.float32, mask=torch.float32, mask_shape=(2, 1, 30, 41),
                 mask_grad=True, sinks=torch.float32)
    for case, options in ((plain, {}), (plain, dict(dropout_p=0.25)), (every, {})):
        (q, k, v), dout, dlse = make_inputs(case)
        mods = make_modifiers(case)
        out, lse = flashop.attention_with_lse(q, k, v, **mods, **case.options(), **options)
        torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    with flashop.config.override(dq_atomics=True):
        (q, k, v), dout, dlse = make_inputs(plain)
        out, lse = flashop.attention_with_lse(q, k, v, causal=True)
        torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    cu = torch.tensor([0, 7, 30], device=DEVICE, dtype=torch.int32)
    q, k, v = (torch.randn(30, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(30, 2, device=DEVICE)).requires_grad_()
    out = flashop.attention_varlen(q, k, v, cu, cu, 23, 23, g=g, causal=True)
    out.sum().backward()
    pages = torch.randn(4, 16, 2, 16, device=DEVICE)
    table = torch.tensor([[3, 1], [0, 2]], device=DEVICE, dtype=torch.int32)
    flashop.attention_varlen(q.detach(), pages, pages, cu, cu, 23, 23, causal=True,
                             block_table=table)


def _decode_calls():
    q = torch.randn(2, 1, 2, 16, device=DEVICE)
    new = torch.randn(2, 1, 1, 16, device=DEVICE)
    lens = torch.tensor([5, 40], device=DEVICE, dtype=torch.int32)
    cache = torch.zeros(3, 64, 1, 16, device=DEVICE)
    for splits in (1, 3):
        flashop.attention_with_kvcache(q, cache.clone(), cache.clone(), new, new,
                                       cache_seqlens=lens, num_splits=splits)
        flashop.attention_with_kvcache(q, cache.clone(), cache.clone(), new, new,
                                       cache_seqlens=lens, num_splits=splits,
                                       cache_batch_idx=torch.tensor([2, 0], device=DEVICE,
                                                                    dtype=torch.int32),
                                       alibi_slopes=torch.rand(2, device=DEVICE),
                                       sinks=torch.randn(2, device=DEVICE),
                                       cache_leftpad=torch.tensor([1, 0], device=DEVICE,
                                                                  dtype=torch.int32),
                                       rotary_cos=torch.ones(64, 8, device=DEVICE),
                                       rotary_sin=torch.zeros(64, 8, device=DEVICE))
    pages = torch.zeros(8, 16, 1, 16, device=DEVICE)
    table = torch.tensor([[3, 1, 0, 5], [2, 4, 6, 7]], device=DEVICE, dtype=torch.int32)
    flashop.attention_with_kvcache(q, pages.clone(), pages.clone(), new, new,
                                   cache_seqlens=lens, block_table=table, num_splits=2)
    # MLA's latent cache (v_cache = k_cache[..., :512]), dense and paged
    q, new = torch.randn(2, 1, 2, 576, device=DEVICE), torch.randn(2, 1, 1, 576, device=DEVICE)
    for splits in (1, 3):
        latent = torch.zeros(3, 64, 1, 576, device=DEVICE)
        flashop.attention_with_kvcache(
            q, latent, latent[..., :512], new, cache_seqlens=lens, num_splits=splits,
            cache_batch_idx=torch.tensor([2, 0], device=DEVICE, dtype=torch.int32),
            cache_leftpad=torch.tensor([1, 0], device=DEVICE, dtype=torch.int32))
        latent = torch.zeros(8, 16, 1, 576, device=DEVICE)
        flashop.attention_with_kvcache(q, latent, latent[..., :512], new, cache_seqlens=lens,
                                       block_table=table, num_splits=splits)


@pytest.mark.parametrize("calls", [_attention_calls, _decode_calls], ids=["attention", "decode"])
def test_absent_tensors_are_none_and_their_flags_say_so(calls):
    launches = _record(calls)
    seen = set()
    for name, kwargs in launches:
        for tensor, flag in GUARDS.items():
            if tensor in kwargs:
                present = kwargs[tensor] is not None
                # a kernel without the flag (the decode merge's parts) always reads the tensor
                assert present == bool(kwargs.get(flag, True)), (name, tensor, flag)
                seen.add((tensor, present))
    # the calls above exercise every guarded tensor both absent and present
    expected = {(tensor, present) for tensor in GUARDS for present in (False, True)}
    if calls is _attention_calls:
        expected = {(t, p) for t, p in expected
                    if t not in _CACHE_ONLY}
    else:
        expected = {(t, p) for t, p in expected
                    if t in ("alibi", "sinks", "block_table") + _CACHE_ONLY}
        assert {"attention_decode_kernel", "mla_decode_kernel"} <= {n for n, _ in launches}
    assert expected <= seen, expected - seen
