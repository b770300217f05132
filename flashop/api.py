"""Public Python API: thin, documented calls of the ``torch.ops.flashop`` operators.

Each function has the name of the operator it calls; validation lives in the operators, so
calling ``torch.ops.flashop.<name>`` directly gets the same checks and messages.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import flashop.ops  # noqa: F401  (registers torch.ops.flashop.*)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              scale: Optional[float] = None) -> Tensor:
    """Scaled dot-product attention, FlashAttention-2 style; differentiable.

    Args:
        q: (B, S_q, H, D) queries.
        k: (B, S_k, H_kv, D) keys; ``H % H_kv == 0`` (grouped-query attention: query head
            ``h`` uses key/value head ``h // (H // H_kv)``).
        v: (B, S_k, H_kv, DV) values.
        causal: mask keys after each query, aligned to the bottom-right corner: query ``i``
            attends key ``j`` iff ``j <= i + S_k - S_q``. Queries that attend no key (when
            ``S_q > S_k``) get output 0.
        scale: multiplies ``q . k``; default ``1 / sqrt(D)``.

    Returns:
        (B, S_q, H, DV) tensor in the inputs' dtype (float16, bfloat16 or float32). Any
        strides are accepted; only a non-unit stride in the last dimension causes a copy.
    """
    return torch.ops.flashop.attention(q, k, v, causal=causal, scale=scale)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                       scale: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """As :func:`attention`, also returning the log-sum-exp of the scaled scores.

    Returns:
        ``(out, lse)``: ``lse`` is (B, H, S_q) float32 in natural-log units,
        ``lse[b, h, i] = log(sum_j exp(scale * q[b, i, h] . k[b, j, h // G]))`` over the keys
        query ``i`` attends (``-inf`` where it attends none). Both outputs are differentiable.
    """
    return torch.ops.flashop.attention_with_lse(q, k, v, causal=causal, scale=scale)
