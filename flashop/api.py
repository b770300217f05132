"""Public Python API: thin, documented calls of the ``torch.ops.flashop`` operators.

Each function has the name of the operator it calls; validation lives in the operators, so
calling ``torch.ops.flashop.<name>`` directly gets the same checks and messages.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

import flashop.ops  # noqa: F401  (registers torch.ops.flashop.*)


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None, *,
              causal: bool = False, scale: Optional[float] = None,
              window_size: Sequence[int] = (-1, -1), softcap: float = 0.0) -> Tensor:
    """Scaled dot-product attention, FlashAttention-2 style; differentiable.

    Args:
        q: (B, S_q, H, D) queries.
        k: (B, S_k, H_kv, D) keys; ``H % H_kv == 0`` (grouped-query attention: query head
            ``h`` uses key/value head ``h // (H // H_kv)``).
        v: (B, S_k, H_kv, DV) values.
        attn_mask: as SDPA's: a boolean keep-mask (True = attend) or an additive float bias
            (float32 or the inputs' dtype; may hold -inf; gets its gradient when it
            requires grad), broadcastable to (B, H, S_q, S_k).
        alibi_slopes: (H,) or (B, H) float32: adds ``-slope * |i + S_k - S_q - j|``
            (FlashAttention's convention). No gradient.
        g: (B, S_k, H) log-decay gate (flash-linear-attention's ``g``; float32 or the
            inputs' dtype): adds ``G[i + S_k - S_q] - G[j]`` with ``G = cumsum(g, dim=1)``.
            Needs ``causal=True``. Differentiable.
        causal: mask keys after each query, aligned to the bottom-right corner: query ``i``
            attends key ``j`` iff ``j <= i + S_k - S_q``.
        scale: multiplies ``q . k``; default ``1 / sqrt(D)``.
        window_size: ``(left, right)``: query ``i`` attends keys ``j`` with
            ``i + S_k - S_q - left <= j <= i + S_k - S_q + right``; -1 leaves that side
            unbounded. Key tiles outside the window are skipped.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)`` (after scaling,
            before the additive terms and masks).

    Queries that attend no key (all masked) get output 0. docs/modifiers.md has the exact
    formula and the order in which the modifiers apply.

    Returns:
        (B, S_q, H, DV) tensor in the inputs' dtype (float16, bfloat16 or float32). Any
        strides are accepted; only a non-unit stride in the last dimension causes a copy.
    """
    return torch.ops.flashop.attention(q, k, v, attn_mask, alibi_slopes, g, causal=causal,
                                       scale=scale, window_size=window_size, softcap=softcap)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None, *,
                       causal: bool = False, scale: Optional[float] = None,
                       window_size: Sequence[int] = (-1, -1), softcap: float = 0.0
                       ) -> tuple[Tensor, Tensor]:
    """As :func:`attention`, also returning the log-sum-exp of the scores.

    Returns:
        ``(out, lse)``: ``lse`` is (B, H, S_q) float32 in natural-log units,
        ``lse[b, h, i] = log(sum_j exp(score(i, j)))`` over the keys query ``i`` attends
        (``-inf`` where it attends none). Both outputs are differentiable.
    """
    return torch.ops.flashop.attention_with_lse(
        q, k, v, attn_mask, alibi_slopes, g, causal=causal, scale=scale,
        window_size=window_size, softcap=softcap)
