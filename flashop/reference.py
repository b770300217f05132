"""Plain PyTorch attention with flashop's signature and conventions, for checking and for
machines without a GPU. It materialises the (S_q, S_k) scores: use it on small inputs."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                        scale: Optional[float] = None,
                        compute_dtype: Optional[torch.dtype] = torch.float32
                        ) -> tuple[Tensor, Tensor]:
    """(out, lse) of softmax(scale * q k^T [+ causal mask]) v, computed in ``compute_dtype``
    (``None``: the inputs' dtype, as plain PyTorch would).

    Layout as ``flashop.attention``: q (B, S_q, H, D), k (B, S_k, H_kv, D), v (B, S_k, H_kv,
    DV); out (B, S_q, H, DV) and lse (B, H, S_q), both in ``compute_dtype``. Causal is
    aligned to the bottom-right corner (query i attends key j iff j <= i + S_k - S_q); a
    query that attends no key gets out 0 and lse -inf. Differentiable.
    """
    dtype = q.dtype if compute_dtype is None else compute_dtype
    S_q, H, D = q.shape[1], q.shape[2], q.shape[3]
    S_k, H_kv = k.shape[1], k.shape[2]
    group = H // H_kv
    scale = D ** -0.5 if scale is None else scale
    qf = q.to(dtype).transpose(1, 2)  # (B, H, S_q, D)
    kf = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (B, H, S_q, S_k)
    i = torch.arange(S_q, device=q.device)[:, None]
    j = torch.arange(S_k, device=q.device)[None, :]
    keep = (j <= i + (S_k - S_q)) if causal else torch.ones_like(j <= i)
    empty = ~keep.any(-1, keepdim=True)  # rows that attend nothing
    # softmax over the row's own keys; empty rows get an unmasked softmax that is then zeroed,
    # so no NaN appears in the forward or the backward
    s = s.masked_fill(~(keep | empty), float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(~keep, 0.0)
    out = torch.matmul(p, vf).transpose(1, 2)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return out, lse
