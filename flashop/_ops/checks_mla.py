"""Checks of caches whose values are the keys' leading columns, MLA's latent cache among
them (multi-head latent attention, DeepSeek-V2/V3, Kimi K2): one row per key of 576 dims,
512 latent then 64 rotary, whose 512 latent dims are the key's value, passed as
``v_cache = k_cache[..., :512]`` (a view: one cache, each row stored and written once).

Whether v_cache is such a view is read from the tensors' storage, offset and strides (no
values: real, fake and functional tensors alike), so the op and its fake decide alike.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashop._ops.checks import MAX_HEAD_DIM

# MLA's head dims: q and the cache rows 512 latent + 64 rotary, the values the 512 latent
MLA_HEAD_DIM, MLA_HEAD_DIM_V = 576, 512


def _leading_view(view: Optional[torch.Tensor], base: Optional[torch.Tensor]) -> Optional[bool]:
    """None where ``view`` and ``base`` do not share memory (or one is None); True where
    ``view`` is ``base[..., :n]`` (dtype, start, strides and the other dims ``base``'s);
    False where their memory overlaps otherwise (two tensors in one allocation that do not
    overlap, as keys and values stacked in one buffer, are separate)."""
    if view is None or base is None or not torch._C._is_alias_of(view, base):
        return None
    if not _spans_overlap(view, base):
        return None
    return bool(view.dtype == base.dtype and view.dim() == base.dim()
                and view.storage_offset() == base.storage_offset()
                and view.stride() == base.stride() and view.shape[:-1] == base.shape[:-1]
                and view.shape[-1] <= base.shape[-1])  # (symbolic sizes: a guard)


def _spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes from the first to the last element of ``a`` and of ``b`` (one
    storage) overlap; empty tensors overlap nothing."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(x: torch.Tensor) -> tuple:
        start = x.storage_offset() * x.element_size()
        last = sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride()))
        return start, start + (last + 1) * x.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def cache_aliasing(k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                   v: Optional[torch.Tensor]) -> tuple:
    """(v_cache of k_cache, v of k) at MLA's head dims, each as _leading_view tells it: None
    where separate, True where the values are the keys' leading columns, False where their
    memory overlaps otherwise (refused by check_cache_aliasing); (None, None) at other head
    dims, whose caches are read and written apart. Part of an eager call's checked
    signature: shapes and strides alone do not tell a view from a tensor of its own."""
    if not is_mla(k_cache, v_cache):
        return None, None
    return _leading_view(v_cache, k_cache), _leading_view(v, k)


def is_mla(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the caches have MLA's head dims, which the latent-cache kernel
    (kernels/mla.py) takes: rows of 576, values of 512."""
    return (k_cache.shape[-1], v_cache.shape[-1]) == (MLA_HEAD_DIM, MLA_HEAD_DIM_V)


def _describe(t: torch.Tensor) -> str:
    return (f"{t.dtype} {tuple(t.shape)} with strides {t.stride()} at storage offset "
            f"{t.storage_offset()}")


def check_cache_aliasing(op: str, k_cache, v_cache, k, v, aliasing: tuple) -> None:
    """v_cache sharing k_cache's memory must be its leading columns, ``k_cache[..., :DV]``;
    the caches then get new values only with their keys: v None, or ``k[..., :DV]``."""
    values_in_keys, new_values_in_keys = aliasing
    DV = v_cache.shape[-1]
    if values_in_keys is False:
        raise ValueError(
            f"{op}: v_cache shares k_cache's memory but is not its leading columns "
            f"k_cache[..., :{DV}] (v_cache {_describe(v_cache)}, k_cache "
            f"{_describe(k_cache)}); for values stored in the keys' rows (MLA's latent "
            f"cache) pass v_cache = k_cache[..., :head_dim_v], else a v_cache of its own")
    if values_in_keys and v is not None and new_values_in_keys is not True:
        kind = "its own memory" if new_values_in_keys is None else "k's memory elsewhere"
        raise ValueError(
            f"{op}: v_cache is k_cache[..., :{DV}] (the values are the keys' leading "
            f"columns, written once with them), so the new values must be k[..., :{DV}] or "
            f"None, got v {tuple(v.shape)} in {kind}; pass v=None")


def check_head_dims(op: str, D: int, DV: int, caches: str, mla: bool = False) -> None:
    """Head dims from 1 to MAX_HEAD_DIM, or MLA's (576, 512) for an operator that takes
    them (``mla``)."""
    if mla and (D, DV) == (MLA_HEAD_DIM, MLA_HEAD_DIM_V):
        return
    if not (1 <= D <= MAX_HEAD_DIM and 1 <= DV <= MAX_HEAD_DIM):
        also = (f", and {MLA_HEAD_DIM} with {MLA_HEAD_DIM_V} for v (MLA's latent cache, "
                f"v_cache = k_cache[..., :{MLA_HEAD_DIM_V}])" if mla else "")
        raise ValueError(f"{op}: head dims from 1 to {MAX_HEAD_DIM} are supported{also}, got "
                         f"{D} for q and k and {DV} for v ({caches})")


def check_latent_options(op: str, mods, k_cache, rotary_cos, k_descale, v_descale,
                         q_descale) -> None:
    """The options the latent-cache kernel takes (MLA's head dims): causal, scale,
    num_splits, paged or dense caches with cache_batch_idx and cache_leftpad; the others are
    refused by name."""
    latent = (f"over MLA's latent cache (head dim {MLA_HEAD_DIM}, v_cache = "
              f"k_cache[..., :{MLA_HEAD_DIM_V}])")
    refused = []
    if mods is not None:
        left, right = mods.window_size_left, mods.window_size_right
        if left != -1 or right != -1:
            refused.append((f"window_size=({left}, {right})", "attend the whole cache "
                            "(window_size=(-1, -1))"))
        if mods.attention_chunk:
            refused.append((f"attention_chunk={mods.attention_chunk}",
                            "attend the whole cache (attention_chunk=0)"))
        if mods.softcap != 0.0:
            refused.append((f"softcap={mods.softcap}", "pass softcap=0.0"))
        for name in ("alibi_slopes", "sinks"):
            if getattr(mods, name) is not None:
                refused.append((name, f"pass {name}=None"))
    if rotary_cos is not None:
        refused.append(("rotary_cos/rotary_sin", "MLA rotates its last 64 dims (q_pe, k_pe), "
                        "not the first ones: rotate them before the call"))
    if k_cache.dtype.itemsize == 1 or any(d is not None for d in (k_descale, v_descale,
                                                                  q_descale)):
        refused.append((f"an fp8 cache ({k_cache.dtype}) or descales",
                        "keep the latent cache in bfloat16 or float16"))
    if refused:
        option, fix = refused[0]
        raise ValueError(f"{op}: {option} is not supported {latent}; {fix}")
