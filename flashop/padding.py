"""Between padded batches and packed variable-length batches.

A padded batch is (B, S, ...) with a (B, S) ``attention_mask``, boolean or integer (True or
nonzero = real token: a tokenizer's int64 mask works as it is);
a packed batch holds only the real tokens, (total, ...), with ``cu_seqlens`` (int32, B + 1
cumulative lengths) marking where each sequence starts, as FlashAttention's varlen functions
and flash-linear-attention's ``cu_seqlens`` expect. Tokens of a sequence need not be left-
aligned in the padded batch: they are packed in order of position.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Unpadded(NamedTuple):
    """A packed batch: ``values`` (total, ...), ``indices`` (total,) positions in the flattened
    (B * S) padded batch, ``cu_seqlens`` (B + 1,) int32, ``max_seqlen`` the longest length."""

    values: Tensor
    indices: Tensor
    cu_seqlens: Tensor
    max_seqlen: int


def _check_mask(x: Tensor, attention_mask: Tensor) -> None:
    if attention_mask.dim() != 2 or x.dim() < 2 or tuple(x.shape[:2]) != tuple(
            attention_mask.shape):
        raise ValueError(
            f"flashop.unpad_input: attention_mask must be (batch, seqlen) matching the first "
            f"two dims of x, got x {tuple(x.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(f"flashop.unpad_input: attention_mask must be bool or an integer "
                         f"tensor (True or nonzero = token), got {attention_mask.dtype}; an "
                         f"additive float mask marks no tokens: pass (mask == 0) for one")


def unpad_input(x: Tensor, attention_mask: Tensor) -> Unpadded:
    """Pack the real tokens of a padded batch ``x`` (B, S, ...) selected by ``attention_mask``
    (B, S), bool or integer (True or nonzero = token, as flash-attn's ``unpad_input`` and
    tokenizers' masks).

    Differentiable in ``x``. Reads the lengths on the host once (``max_seqlen`` is a Python
    int), so call it outside CUDA-graph-captured regions, as FlashAttention's ``unpad_input``.
    """
    _check_mask(x, attention_mask)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask != 0
    seqlens = attention_mask.sum(dim=1, dtype=torch.int32)
    indices = attention_mask.flatten().nonzero(as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    values = x.flatten(0, 1).index_select(0, indices)
    return Unpadded(values, indices, cu_seqlens, max_seqlen)


def pad_input(values: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Scatter a packed batch ``values`` (total, ...) back to (batch, seqlen, ...), zeros at
    the padding. ``indices`` as returned by :func:`unpad_input`. Differentiable in ``values``."""
    if values.shape[0] != indices.shape[0]:
        raise ValueError(f"flashop.pad_input: values has {values.shape[0]} tokens but indices "
                         f"has {indices.shape[0]}")
    out = values.new_zeros((batch * seqlen, *values.shape[1:]))
    out = out.index_copy(0, indices, values)
    return out.view(batch, seqlen, *values.shape[1:])
